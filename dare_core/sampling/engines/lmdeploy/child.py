"""The lmdeploy engine's own process (docs/sampling.md#engines).

lmdeploy cannot share DARE's environment (it pins peft <= 0.14 and torch <= 2.12.1; DARE needs
newer ones), so it runs here, in the python of its own environment, started by the rollout engine
in DARE's process (`process.py`). This file is run by path and imports only the standard library,
torch and lmdeploy: nothing of DARE, whose other dependencies that environment need not have.

The parent talks over one socket (a `multiprocessing.connection.Connection` on an inherited file
descriptor): each request is a dict `{"op": name, ...}`, each reply `{"ok": value}` or
`{"error": traceback}`, both in plain pickle (`send`/`recv`): the connection's own pickler would hand
CPU tensors over as shared-memory file descriptors through multiprocessing's resource sharer, which
only a multiprocessing child may call back. One request at a time; the loop ends on `close` or when the parent's end
of the socket goes away (the parent died), so the engine never outlives its trainer.

Weights arrive on the GPU: the parent packs checkpoint-named tensors into a staging buffer of its
own and shares that buffer once through CUDA IPC; each `load_weights` names the tensors' places in
it, and they are loaded with lmdeploy's own per-model loader (the path of its `update_params`),
in place, so captured CUDA graphs stay valid.
"""
from __future__ import annotations

import asyncio
import itertools
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import torch

# our request status -> lmdeploy's ResponseType names that mean "going on" or "done"
OK_STATUS = ("SUCCESS", "FINISH")


def patch_mask_id() -> None:
    """lmdeploy's SDAR config builder sets the released checkpoints' mask id (151669) whatever
    config.json says; a model with another mask id (a tiny one DARE trained with its own tokenizer)
    would denoise from the wrong token. Read config.json's `mask_token_id` where it has one."""
    from lmdeploy.pytorch.configurations import sdar

    builder = sdar.SDARModelConfigBuilder
    if getattr(builder, "_dare_mask_id", False):
        return
    released = builder.build.__func__

    def build(cls, hf_config, model_path=None, **kwargs):
        cfg = released(cls, hf_config, model_path, **kwargs)
        mask = getattr(hf_config, "mask_token_id", None)
        if mask is not None:
            cfg.dllm_mask_token = int(mask)
        return cfg

    builder.build = classmethod(build)
    builder._dare_mask_id = True


class Server:
    def __init__(self):
        self.engine = None
        self.instances: list = []
        self.session_ids = itertools.count(1)
        self.staging: dict[int, torch.Tensor] = {}  # key -> the parent's staging buffer, mapped here
        self.records = None  # the probe's per-forward records, while it is on

    # ---- requests
    def start(self, model_path: str, engine_config: dict) -> dict:
        import lmdeploy
        from lmdeploy import PytorchEngineConfig
        from lmdeploy.pytorch.engine import Engine

        patch_mask_id()
        config = PytorchEngineConfig(**engine_config)
        # the folder is a view without auto_map (folder.py): no checkpoint code is needed or run
        self.engine = Engine.from_pretrained(model_path, engine_config=config, trust_remote_code=False)
        return {"max_session_len": int(self.engine.max_session_len), "lmdeploy": lmdeploy.__version__,
                "torch": torch.__version__, "device": torch.cuda.get_device_name()}

    def generate(self, prompts: list, request: dict, seeds: list) -> list:
        from lmdeploy import GenerationConfig

        # one EngineInstance per in-flight request, as lmdeploy's own async engine does
        while len(self.instances) < len(prompts):
            self.instances.append(self.engine.create_instance())

        async def one(instance, ids: list, seed) -> list:
            session_id = next(self.session_ids)
            tokens: list = []
            try:
                async for out in instance.async_stream_infer(session_id, ids, gen_config=GenerationConfig(**request, random_seed=seed)):
                    if out.status.name not in OK_STATUS:
                        raise RuntimeError(f"lmdeploy request {session_id} ended with {out.status.name}")
                    tokens.extend(out.token_ids)  # each output carries the new ids only
            finally:
                instance.end(session_id)  # frees its KV blocks (a no-op where the engine already ended it)
            return tokens

        async def run_all() -> list:
            return list(await asyncio.gather(*(one(inst, p, s) for inst, p, s in zip(self.instances, prompts, seeds))))

        return self.instances[0].req_sender.run_until_complete(run_all())

    def load_weights(self, key: int, handle, tensors: list, finished: bool) -> int:
        """Load `tensors` [(name, shape, dtype name, byte offset)] from staging buffer `key` (mapped
        from `handle` the first time it is named) into the model; returns how many were loaded."""
        from lmdeploy.pytorch.weight_loader.model_weight_loader import ModelWeightLoader, process_weights_after_loading

        if handle is not None:
            rebuild, args = handle
            args = list(args)
            args[6] = torch.cuda.current_device()  # the parent's device index means another GPU numbering
            self.staging = {key: rebuild(*args)}  # an older buffer is released with its mapping
        buffer = self.staging[key]
        named = []
        for name, shape, dtype, offset in tensors:
            dt = getattr(torch, dtype)
            numel = 1
            for n in shape:
                numel *= n
            nbytes = numel * torch.empty((), dtype=dt).element_size()
            named.append((name, buffer[offset:offset + nbytes].view(dt).view(shape)))
        agent = self.engine.executor.model_agent
        with agent.all_context():
            model = agent.patched_model.get_model()
            model.load_weights(ModelWeightLoader._rename_weights_iterator(iter(named), model))
            if finished:
                process_weights_after_loading(model)
        torch.cuda.synchronize()  # the parent reuses the buffer once this returns
        return len(named)

    def probe(self, on: bool) -> None:
        """Record every model forward (its input ids, history and the logits it produced) until
        turned off: the teacher-forced parity check compares them with DARE's model."""
        agent = self.engine.executor.model_agent
        if on and self.records is None:
            original = agent._async_model_forward
            records: list = []

            async def recording(inputs, *args, **kwargs):
                ret = await original(inputs, *args, **kwargs)
                if not inputs.is_dummy:
                    records.append({"input_ids": inputs.input_ids.flatten().tolist(), "history": inputs.history_lengths.tolist(),
                                    "seq_length": inputs.seq_length.tolist(), "decoding": bool(inputs.is_decoding),
                                    "logits": ret["logits"].reshape(-1, ret["logits"].shape[-1]).cpu()})  # as computed (bf16)
                return ret

            agent._async_model_forward = recording
            self.records, self._unprobed = records, original
        elif not on and self.records is not None:
            agent._async_model_forward = self._unprobed
            self.records = None

    def take_records(self) -> list:
        """The records so far (emptied); none while the probe is off."""
        if self.records is None:
            return []
        records, self.records[:] = list(self.records), []
        return records

    def close(self) -> None:
        self.instances.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.staging.clear()


def send(conn: Connection, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def serve(conn: Connection) -> None:
    server = Server()
    ops = {"start": server.start, "generate": server.generate, "load_weights": server.load_weights,
           "probe": server.probe, "take_records": server.take_records}
    while True:
        try:
            request = recv(conn)
        except (EOFError, OSError):  # the parent is gone
            break
        op = request.pop("op")
        if op == "close":
            server.close()
            send(conn, {"ok": None})
            break
        try:
            reply = {"ok": ops[op](**request)}
        except BaseException:  # the parent raises it with this traceback
            reply = {"error": traceback.format_exc()}
        send(conn, reply)
    server.close()


def main(argv: list) -> int:
    conn = Connection(int(argv[1]))
    print(f"[dare lmdeploy child] python {sys.version.split()[0]}, torch {torch.__version__}: serving", flush=True)
    serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
