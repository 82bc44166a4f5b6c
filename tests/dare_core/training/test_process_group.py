"""A rank of a gloo group ends its process past the interpreter's teardown, keeping what exit
handlers and buffered output would have done."""
import subprocess
import sys

from pipeline_helpers import worker_env

PROBE = """
import atexit, logging, sys
from dare_core.process.process_group import exit_before_teardown

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


INIT = """
import torch
from dare_core.process.process_group import init_distributed
init_distributed()
print("group", torch.distributed.get_world_size())
"""


def test_making_the_group_prints_no_build_notice():
    """DeepSpeed prints 'DeepSpeed ... built successfully' whenever a CPU stage loads its cached
    shared-memory op; the stages' logs no longer carry it, and other output passes."""
    r = subprocess.run([sys.executable, "-c", INIT], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "group 1" in r.stdout and "built successfully" not in r.stdout + r.stderr, r.stdout


def test_the_filter_keeps_other_lines(capsys):
    from dare_core.process.process_group import _quiet_build_notice

    with _quiet_build_notice():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("something else")
    assert capsys.readouterr().out == "something else\n"
