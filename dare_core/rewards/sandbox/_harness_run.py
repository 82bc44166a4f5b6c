"""The tests' side of a test run (role `tests`): run the problem's tests against the program's names
and compute the verdict once they have all run. Loaded by `_sandbox_child.py` into the tests' jail,
which never runs candidate code.

The tests execute against proxies of the program's names (`_harness_values`), only those the job
lists (the problem's choice, `dare_core.rewards.sandbox.test_names`); builtins and modules are their own, and
`pytest` is the jail's small one (`_pytest_shim`). Every check runs whatever the earlier ones found
(`_harness_rewrite`), then top-level `test*` functions, `Test*` classes and unittest cases run, each
whatever the others did; a failure is recorded, never raised to the end. Only what the program
itself did wrong in the protocol (a malformed reply, leaving early, a missing required name) ends
the run at once. The verdict (`ok` when nothing failed) is this process's alone.
"""
import builtins
import importlib
import re
import sys
import types

from __main__ import Channel, describe, report
from _harness_rewrite import helpers, rewrite
from _harness_values import Failures, Link
import pytest as pytest_shim

# tests that name NaN expect it as an answer somewhere: then a NaN from the program is theirs to judge
_NAN = re.compile(r"(?i)(?<![a-z])nan(?![a-z])|isnan|nan_ok")


def _recording_result(unittest, failures):
    class Recording(unittest.TestResult):
        """Records every failure, subtests included, and lets the run go on; an expected failure
        (`unittest.expectedFailure`) drops what its test recorded, and succeeding is its failure."""

        def startTest(self, test):
            super().startTest(test)
            self.start, self.unexpected = failures.mark(), False

        def addError(self, test, err):
            failures.record(f"{test}: {describe(err[1])}")

        addFailure = addError

        def addSubTest(self, test, subtest, err):
            if err is not None:
                failures.record(f"{subtest}: {describe(err[1])}")

        def addUnexpectedSuccess(self, test):
            self.unexpected = True

        def stopTest(self, test):
            method = getattr(test, getattr(test, "_testMethodName", ""), None)
            if getattr(method, "__unittest_expecting_failure__", False) or getattr(test, "__unittest_expecting_failure__", False):
                failed = failures.mark() > self.start
                failures.drop(self.start)
                if self.unexpected and not failed:
                    failures.record(f"{test}: unexpected success")
            super().stopTest(test)

    return Recording()


def _run_collected(namespace, names, failures):
    """Run what the tests define in pytest or unittest style: `test*` functions, `Test*` classes
    (methods `test*`), and `unittest.TestCase` subclasses. Where the tests define some, at least
    one must run without being skipped."""
    unittest, collected, ran = sys.modules.get("unittest"), False, 0
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", None) != "__main__":  # imported (`from unittest import TestCase`)
            continue
        if name.startswith("test") and type(obj) is types.FunctionType and not hasattr(obj, "_pytest_fixture"):
            collected, ran = True, ran + pytest_shim.run_test(obj, namespace, failures)
        elif isinstance(obj, type) and unittest is not None and issubclass(obj, unittest.TestCase):
            result = _recording_result(unittest, failures)
            unittest.defaultTestLoader.loadTestsFromTestCase(obj).run(result)
            collected, ran = True, ran + result.testsRun - len(result.skipped)
        elif isinstance(obj, type) and name.startswith("Test"):
            for attribute in sorted(dir(obj)):
                if attribute.startswith("test") and type(getattr(obj, attribute)) is types.FunctionType:
                    collected = True
                    ran += pytest_shim.run_test(getattr(obj, attribute), namespace, failures, owner=obj)
    if collected and not ran:  # every test skipped (a module the jail lacks): nothing was checked
        failures.record("no test ran")


def run_tests(job, tree):
    """The verdict of the tests (`job["tests"]`, parsed as `tree`) against the program's process."""
    def fail(error):  # at once: what the program did to the protocol, not a check of the tests
        report(job["result_fd"], {"ok": False, "error": str(error)[:500]})

    failures = Failures()
    link = Link(Channel(job["channel"][0], job["channel"][1]), fail, failures, bool(_NAN.search(job["tests"])))
    manifest = link.receive()
    if "error" in manifest:
        fail(str(manifest["error"]))
    sent = manifest.get("names") if type(manifest.get("names")) is dict else {}
    # the problem's names only, whatever the manifest holds: builtins and modules stay the tests' own
    namespace = {"__name__": "__main__", "__builtins__": builtins, **helpers(failures, job["tests"])}
    for name in job["modules"]:  # modules the tests use without importing them
        try:
            namespace[name] = importlib.import_module(name)
        except Exception:  # noqa: BLE001
            pass
    program = {}
    for name in job["names"]:
        if name in sent:
            program[name] = link.value(sent[name])
        elif name in job["required"]:  # else a builtin of that name would stand in for it
            fail(f"the program does not define {name}")
    namespace.update(program)
    module = types.ModuleType("solution")
    module.__dict__.update(program)
    sys.modules["solution"] = module  # so tests may `from solution import f`
    if "unittest" in job["tests"]:
        # the real unittest.main() would look for test cases in this start-up code's `__main__`: the
        # tests' script ends there as with its exit, and their test cases run next, collected
        import unittest
        unittest.main = lambda *args, **kwargs: sys.exit(0)
    code = compile(rewrite(tree), "/sandbox/tests.py", "exec")
    try:
        exec(code, namespace)
    except SystemExit as exc:  # the tests' own exit (never the candidate's: it is not relayed)
        if exc.code not in (None, 0):
            failures.record(exc)
    except BaseException as exc:  # noqa: BLE001  (what no guard catches: a skip of the whole script, ...)
        # a script that skips itself (`importorskip` of a module the jail lacks) checked nothing
        failures.record(exc)
    # what the tests defined (or redefined), not the candidate's names nor the harness's helpers
    names = [n for n, v in list(namespace.items()) if not n.startswith("__") and v is not program.get(n)]
    _run_collected(namespace, names, failures)
    return failures.verdict()
