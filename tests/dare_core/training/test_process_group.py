"""A rank of a gloo group ends its process past the interpreter's teardown, keeping what exit
handlers and buffered output would have done."""
import subprocess
import sys

from pipeline_helpers import worker_env

PROBE = """
import atexit, logging, sys
from dare_core.training.process_group import exit_before_teardown

out = sys.argv[1]
logging.basicConfig(filename=out + ".log", level=logging.INFO)
logging.info("logged before exit")  # a FileHandler flushes its stream at shutdown (an exit handler)
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
sys.stdout.write("buffered, no newline")
exit_before_teardown(3)
print("never reached")
"""


def test_exit_before_teardown_runs_exit_handlers_and_flushes_output(tmp_path):
    out = tmp_path / "probe"
    r = subprocess.run([sys.executable, "-c", PROBE, str(out)], env=worker_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert r.stdout == "buffered, no newline"
    assert (tmp_path / "probe.atexit").read_text() == "ran"
    assert "logged before exit" in (tmp_path / "probe.log").read_text()
