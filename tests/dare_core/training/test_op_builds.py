"""The first load of a DeepSpeed op compiles it (a minute or more on 2 cores, silent otherwise): a line
says what is built, why and about how long before, and how long it took after; an op already built
says nothing. Cheap: the build is what DeepSpeed leaves behind (`<op>.so` in TORCH_EXTENSIONS_DIR),
made by the test inside the announced block."""
from __future__ import annotations

import logging
import re

from dare_core.training.op_builds import announced

LOGGER = "dare_core.training.op_builds"


def build(root, op):
    (root / op).mkdir(exist_ok=True)
    (root / op / f"{op}.so").write_bytes(b"")


def test_a_build_is_announced_before_and_timed_after(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    caplog.set_level(logging.INFO, logger=LOGGER)
    with announced("CPUAdamBuilder"):
        before = [r.getMessage() for r in caplog.records]
        build(tmp_path, "cpu_adam")
    assert before == [f"DeepSpeed compiles its CPU Adam op (cpu_adam) into {tmp_path / 'cpu_adam'}: the optimizer is "
                      "offloaded to host memory (launch.offload_optimizer), and the op is built on first use, once per "
                      "checkout; about 1-2 min on 2 CPU cores, with no output until it is done"]
    after = [r.getMessage() for r in caplog.records][1:]
    assert len(after) == 1 and re.fullmatch(rf"DeepSpeed built its CPU Adam op \(cpu_adam\) in \d+\.\d s; later stages "
                                            rf"load it from {re.escape(str(tmp_path / 'cpu_adam'))}", after[0]), after
    caplog.clear()
    with announced("CPUAdamBuilder"):  # built: nothing to say
        pass
    assert not caplog.records


def test_one_rank_a_machine_announces_the_shared_memory_op(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setenv("LOCAL_RANK", "1")  # waits on rank 0's build in silence
    with announced("ShareMemCommBuilder"):
        pass
    assert not caplog.records
    monkeypatch.setenv("LOCAL_RANK", "0")
    with announced("ShareMemCommBuilder"):
        build(tmp_path, "deepspeed_shm_comm")
    assert [r.getMessage().split(":")[0] for r in caplog.records][:1] == [
        f"DeepSpeed compiles its shared-memory collectives op (deepspeed_shm_comm) into {tmp_path / 'deepspeed_shm_comm'}"]
    assert "every process group on the CPU loads it" in caplog.records[0].getMessage() and "20-40 s" in caplog.records[0].getMessage()
    assert caplog.records[1].getMessage().startswith("DeepSpeed built its shared-memory collectives op (deepspeed_shm_comm) in ")
