"""Test modules import helpers with `from conftest import ...`. With pytest's default import mode every
conftest.py is the module `conftest`, so a second one shadows tests/conftest.py for whichever test is
collected after it (a collection error in CI, never locally when run file by file)."""
from pathlib import Path


def test_tests_have_one_conftest():
    tests = Path(__file__).parent
    extra = sorted(str(p.relative_to(tests)) for p in tests.rglob("conftest.py") if p.parent != tests)
    assert not extra, f"put fixtures in tests/conftest.py, not {extra}"
