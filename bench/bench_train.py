"""Training throughput and peak memory of the DFlash drafter step (CPU here; GPU with --device cuda).

Prints supervised-sequence tokens/s and drafter query slots/s for the full training step (online target
forward + anchors + masks + drafter forward/backward + chunked decayed CE + AdamW), against a baseline
measured in the same run: the target forward alone (the floor any online trainer pays).

    python bench/bench_train.py                       # tiny demo-sized target on CPU
    python bench/bench_train.py --hidden 4096 --target-layers 36 --draft-layers 5 --device cuda --bf16

Sequence packing on real token shards (the demo's after `snakemake --profile local`): one pass over the
same records padded (batch_size records per step) and packed (batch_size rows of up to the longest
record's tokens, dflash_pipeline.train.packing; the same anchors per record), tokens/s of each and the ratio:

    python bench/bench_train.py --tokens results/tokens/*/*.parquet --target resources/demo-target \
        --probe results/probe/demo.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_pipeline.drafter import model as M
from dflash_pipeline.train.run import StepContext, training_step


#: ``--smoke``: a tiny target and drafter, a few steps of the step mode (tests/bench/test_benches.py).
SMOKE = {
    "hidden": 64,
    "target_layers": 6,
    "draft_layers": 1,
    "vocab": 256,
    "block_size": 4,
    "num_anchors": 4,
    "batch": 2,
    "seq": 32,
    "steps": 2,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--target-layers", type=int, default=8)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1088)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-anchors", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flex"])
    p.add_argument("--tokens", nargs="+", help="token shards: run the packing comparison on them")
    p.add_argument("--target", help="target directory (with --tokens)")
    p.add_argument("--probe", help="probe JSON (with --tokens)")
    p.add_argument("--records", type=int, default=192, help="records of the packing comparison (with --tokens)")
    p.add_argument("--pack-max-tokens", type=int, help="tokens per packed row (default: the longest record)")
    p.add_argument("--pack-batch", type=int, help="packed rows per step (default: --batch)")
    p.add_argument("--repeats", type=int, default=3, help="alternating passes of each (best kept; with --tokens)")
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes (seconds), for the suite's smoke test: {SMOKE}")
    a = p.parse_args()
    if a.smoke:
        vars(a).update(SMOKE)
    if a.tokens:
        return packing_main(a)
    dev = torch.device(a.device)
    heads = max(1, a.hidden // 128) if a.hidden >= 1024 else max(1, a.hidden // 32)
    tcfg = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_hidden_layers=a.target_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=a.hidden // heads,
        max_position_embeddings=max(4096, a.seq + 64),
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    target = Qwen3ForCausalLM(tcfg).to(dev, dtype).eval().requires_grad_(False)
    from dflash_pipeline.probe import build_target_layer_ids

    k = min(5, a.target_layers - 3) if a.target_layers >= 6 else 2
    ids_layers = build_target_layer_ids(a.target_layers, k)
    dcfg = M.drafter_config_from_target(
        tcfg,
        block_size=a.block_size,
        num_draft_layers=a.draft_layers,
        target_layer_ids=ids_layers,
        mask_token_id=a.vocab - 1,
    )
    drafter = M.DFlashDrafter(dcfg).to(dev)  # fp32 master weights
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    backend = a.backend if a.backend != "auto" else ("flex" if dev.type == "cuda" else "sdpa")
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, a.vocab - 2, (a.batch, a.seq), generator=g).to(dev),
        "loss_mask": torch.cat([torch.zeros(a.batch, a.seq // 2), torch.ones(a.batch, a.seq - a.seq // 2)], 1)
        .to(torch.uint8)
        .to(dev),
        "attention_mask": torch.ones(a.batch, a.seq, dtype=torch.long, device=dev),
    }
    probe = {"drafter": {"target_layer_ids": ids_layers, "mask_token_id": a.vocab - 1}}
    cfg = {"num_anchors": a.num_anchors}
    gamma = M.loss_decay_gamma(a.block_size)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    ctx = StepContext(
        drafter=drafter,
        target=target,
        probe=probe,
        num_anchors=cfg["num_anchors"],
        block_size=a.block_size,
        gamma=gamma,
        generator=g,
        backend=backend,
    )

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            loss, _ = training_step(ctx, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def target_only():
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            target(input_ids=batch["input_ids"], output_hidden_states=True)

    for fn in (step, target_only):  # warm-up (and compile on GPU)
        fn()
        fn()
        sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    dt = (time.perf_counter() - t) / a.steps
    t = time.perf_counter()
    for _ in range(a.steps):
        target_only()
    sync()
    base = (time.perf_counter() - t) / a.steps
    toks = a.batch * a.seq
    slots = a.batch * min(a.num_anchors, a.seq // 2) * a.block_size
    n_params = M.count_parameters(drafter)
    # drafter FLOPs ≈ 6 · params · query slots (fwd+bwd) + target 2 · params · tokens (fwd)
    flops = 6 * n_params * slots + 2 * sum(p.numel() for p in target.parameters()) * toks
    print(
        f"device={dev} backend={backend} bf16={a.bf16} hidden={a.hidden} draft_layers={a.draft_layers} drafter_params={n_params / 1e6:.1f}M"
    )
    print(
        f"train step: {dt * 1000:.1f} ms  ->  {toks / dt:,.0f} sequence tokens/s, {slots / dt:,.0f} query slots/s, {flops / dt / 1e12:.2f} TFLOP/s"
    )
    print(
        f"baseline (target forward only): {base * 1000:.1f} ms  ->  {toks / base:,.0f} tokens/s;  step/baseline = {dt / base:.1f}x"
    )
    if dev.type == "cuda":
        print(
            f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB;  MFU vs 989 TFLOP/s bf16 dense (H100/H200): {flops / dt / 989e12 * 100:.1f}%"
        )
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


def packing_main(a) -> None:
    """Padded vs packed training steps over the same records; prints tokens/s of each and the ratio."""
    import random

    from dflash_pipeline.train import packing as P
    from dflash_pipeline.target import loading as T
    from dflash_pipeline.train.run import build_drafter, collate, load_token_shards

    dev = torch.device(a.device)
    records = load_token_shards(a.tokens)
    random.Random(0).shuffle(records)
    records = records[: a.records]
    probe = json.loads(open(a.probe, encoding="utf-8").read())
    target = T.load_target(a.target, device=dev)
    drafter = build_drafter(target, probe).to(dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    bs = probe["drafter"]["block_size"]
    backend = a.backend if a.backend != "auto" else ("flex" if dev.type == "cuda" else "sdpa")
    ctx = StepContext(
        drafter=drafter,
        target=target,
        probe=probe,
        num_anchors=a.num_anchors,
        block_size=bs,
        gamma=M.loss_decay_gamma(bs),
        generator=torch.Generator().manual_seed(0),
        backend=backend,
    )
    padded = [collate(records[i : i + a.batch]) for i in range(0, len(records), a.batch)]
    rows = P.PackedDataset(records, a.pack_max_tokens or max(len(r[0]) for r in records))
    items = [rows[i] for i in range(len(rows))]
    pb = a.pack_batch or a.batch
    packed = [P.collate_packed(items[i : i + pb]) for i in range(0, len(items), pb)]
    P.check_target_isolates_records(target, probe["drafter"]["target_layer_ids"])
    tokens = sum(len(r[0]) for r in records)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one_pass(batches) -> float:
        t = time.perf_counter()
        for batch in batches:
            batch = {k: v.to(dev) for k, v in batch.items()}
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
                loss, _ = training_step(ctx, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t

    one_pass(padded[:1]), one_pass(packed[:1])  # warm-up
    t_pad, t_pack = float("inf"), float("inf")
    for _ in range(a.repeats):  # alternate, keep the best pass of each (a shared machine is noisy)
        t_pad, t_pack = min(t_pad, one_pass(padded)), min(t_pack, one_pass(packed))
    cells_pad = sum(int(b["input_ids"].numel()) for b in padded)
    cells_pack = sum(int(b["input_ids"].numel()) for b in packed)
    print(
        f"records={len(records)} tokens={tokens} batch={a.batch} packed rows/step={pb} row tokens={rows.bins and max(sum(len(records[j][0]) for j in b) for b in rows.bins)} "
        f"num_anchors={a.num_anchors} device={dev} backend={backend}"
    )
    print(
        f"padded : {len(padded)} steps, {t_pad:.1f} s, {tokens / t_pad:,.0f} tokens/s, padding {1 - tokens / cells_pad:.0%}"
    )
    print(
        f"packed : {len(packed)} steps, {t_pack:.1f} s, {tokens / t_pack:,.0f} tokens/s, padding {1 - tokens / cells_pack:.0%} "
        f"({len(records) / len(rows):.1f} records/row)"
    )
    print(f"packed / padded tokens/s = {t_pad / t_pack:.2f}x")


if __name__ == "__main__":
    main()
