"""Throughput of ``rrh audit DUMP --trainer-trace DIR``'s join against reading the trace's JSONL alone.

``python -m tests.bench_trainer_trace [--samples N] [--layers L]`` (needs verl 0.9.1 on megatron-core
0.19.2) writes one step of a verl RolloutSkip dump (verl's ``DataProto.save_to_disk``) and the router
trace a correct R3 forward of it writes at TP1 (records built through verl's packing, as megatron-core's
tracer formats them: one JSON line per router call), then times, on one process:

- ``json``: ``json.loads`` of every line (the floor of any reader of this format);
- ``reader``: ``megatron_lm.rank_steps``, every record parsed and checked (``check_trace``'s rules);
- ``join``: ``trace_join.records``, the dump read, verl's packing computed and every row placed;
- ``audit``: the joined records written as the run layout and audited (serial).

Figures are MiB of trace per second.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

E, K, MAX_TOKENS = 128, 8, 8192


def _write(root: Path, samples: int, layers: int, seed: int = 0) -> tuple[Path, Path]:
    import torch
    from verl import DataProto

    from harness.audit.trace.verl_packing import VerlBatching, step_packing

    rng = np.random.default_rng(seed)
    prompts, responses = rng.integers(64, 512, samples), rng.integers(64, 1024, samples)
    p_max, r_max = int(prompts.max()), int(responses.max())
    width = p_max + r_max
    attention = np.zeros((samples, width), dtype=np.int64)
    response_mask = np.zeros((samples, r_max), dtype=np.int64)
    routes = np.zeros((samples, width, layers, K), dtype=np.int16)
    picks = np.argsort(rng.random((samples * width, E)), axis=1)[:, :K].reshape(samples, width, K)
    for i, (p, r) in enumerate(zip(prompts.tolist(), responses.tolist(), strict=True)):
        attention[i, p_max - p : p_max + r] = 1
        response_mask[i, :r] = 1
        routes[i, p_max - p : p_max + r - 1] = picks[i, : p + r - 1, None, :]
    ids = np.zeros((samples, width), dtype=np.int64)
    step = root / "dump" / "GBS_N1_in_out" / "1"
    step.mkdir(parents=True)
    DataProto.from_dict(
        tensors={
            "prompts": torch.as_tensor(ids[:, :p_max]),
            "responses": torch.as_tensor(ids[:, p_max:]),
            "input_ids": torch.as_tensor(ids),
            "attention_mask": torch.as_tensor(attention),
            "response_mask": torch.as_tensor(response_mask),
            "routed_experts": torch.as_tensor(routes),
        }
    ).save_to_disk(str(step / "gen_batch.dp"))
    (step / "meta.json").write_text(json.dumps({"global_steps": 1}))
    (plan,) = step_packing(attention, response_mask, VerlBatching(max_token_len_per_gpu=MAX_TOKENS))
    trace = root / "trace"
    trace.mkdir()
    with open(trace / "router_trace_rank0.jsonl", "w") as out:
        for mb in plan:
            rows = np.tile(np.arange(K), (mb.packed_rows, layers, 1))
            for b, start, n in zip(mb.rows, mb.cu_seqlens_padded, mb.lengths, strict=False):
                col = int(p_max - attention[b, :p_max].sum())
                rows[start : start + n - 1] = routes[b, col : col + n - 1]
            for layer in range(layers):
                record = {
                    "step": 1,
                    "stage": "pre_dispatch",
                    "block": "decoder",
                    "layer": layer,
                    "rank": 0,
                    "num_tokens": mb.packed_rows,
                    "topk": K,
                    "top_indices": rows[:, layer].tolist(),
                }
                out.write(json.dumps(record) + "\n")
    return step.parent, trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    from harness.audit import RunWriter, audit_run
    from harness.audit.importers import megatron_lm
    from harness.audit.trace import join as trace_join
    from harness.audit.trace.verl_packing import VerlBatching

    with tempfile.TemporaryDirectory() as tmp:
        dump, trace = _write(Path(tmp), args.samples, args.layers)
        file = trace / "router_trace_rank0.jsonl"
        mib = file.stat().st_size / 2**20
        figures = {}
        start = time.perf_counter()
        with open(file, "rb") as handle:
            for line in handle:
                json.loads(line)
        figures["json"] = time.perf_counter() - start
        start = time.perf_counter()
        for _ in megatron_lm.rank_steps(file, 0, E):
            pass
        figures["reader"] = time.perf_counter() - start
        layout = trace_join.TrainerLayout(VerlBatching(max_token_len_per_gpu=MAX_TOKENS))
        moe = list(range(args.layers))
        start = time.perf_counter()
        records = list(trace_join.records(dump, trace, layout, num_experts=E, moe_layers=moe))
        figures["join"] = time.perf_counter() - start
        start = time.perf_counter()
        with RunWriter(Path(tmp) / "run") as writer:
            for record in records:
                writer.write(record)
        result = audit_run(Path(tmp) / "run", executor="serial")
        figures["audit"] = time.perf_counter() - start
        assert not result.violated, [i.line() for i in result.invariants if i.status == "violated"]
        tokens = sum(len(r.tokens) for r in records)
        print(f"trace {mib:.1f} MiB ({tokens} tokens x {args.layers} layers x top-{K}), one process:")
        for name, seconds in figures.items():
            print(f"  {name:<7} {seconds:7.2f} s  {mib / seconds:7.2f} MiB/s")


if __name__ == "__main__":
    main()
