"""(a) The fused per-rank embedding module vs per-table nn.EmbeddingBag with a torch optimizer.

Same tables (all tables of the model, as the only rank of a 1-rank plan holds them), same ids (a batch of synthetic
samples), forward + backward + update, interleaved rounds (other processes' load hits all alike; the fastest round
of each is reported, and the median of the per-round ratios):
  fused            one fbgemm TBE, exact row-wise Adagrad fused into its backward (what the runtime runs)
  bag_sparse       one nn.EmbeddingBag(mode="sum", sparse=True) per table + torch.optim.Adagrad on sparse gradients
  bag_dense        one nn.EmbeddingBag(mode="sum") per table (PyTorch's default dense weight gradient) + Adagrad
One torch thread by default: on this 2-core machine that is what each of the 2 training ranks gets, and 2 threads
under load from other processes slow fbgemm's CPU backward ~3x (OpenMP oversubscription).

    .venv/bin/python bench/bench_embedding.py [--model criteo_kaggle --rows-cap 1000000] [--batch 4096] [--out x.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cap_rows, compose_cfg, emit, record_results  # noqa: E402

from neocfg.data.synthetic import SyntheticData  # noqa: E402
from neocfg.runtime.embedding import init_rows, make_tbe  # noqa: E402
from neocfg.runtime.layout import GroupKey  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dlrm_tiny")
    ap.add_argument("--rows-cap", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3, help="iterations per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad",
                    help="adagrad: fused exact row-wise Adagrad vs torch Adagrad; sgd: fused exact SGD vs torch SGD")
    ap.add_argument("--record", action="store_true", help="write the result into bench/RESULTS.md")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    sparse_opt = "exact_rowwise_adagrad" if a.optimizer == "adagrad" else "exact_sgd"
    cfg = compose_cfg([f"model={a.model}", *cap_rows(a.model, a.rows_cap), f"train.sparse_optimizer={sparse_opt}"])
    tables = cfg.model.tables
    tc = cfg.train
    data = SyntheticData.for_model(cfg.model, cfg.dsi.seed)
    batches = [data.batch(i * a.batch, a.batch) for i in range(4)]

    tbe = make_tbe([(t.num_embeddings, t.embedding_dim) for t in tables], GroupKey("fp32", "hbm"), tc,
                   torch.device("cpu"))
    bags = {k: nn.ModuleList(nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum", sparse=k == "bag_sparse")
                             for t in tables) for k in ("bag_sparse", "bag_dense")}
    with torch.no_grad():
        for i, (t, w) in enumerate(zip(tables, tbe.split_embedding_weights())):
            init = init_rows(tc.seed, i, t.num_embeddings, t.embedding_dim, 0, t.num_embeddings)
            w.copy_(init)
            for mods in bags.values():
                mods[i].weight.copy_(init)
    torch_opt = torch.optim.Adagrad if a.optimizer == "adagrad" else torch.optim.SGD
    opts = {k: torch_opt(m.parameters(), lr=tc.sparse_learning_rate) for k, m in bags.items()}
    per_table = []  # per-table (ids, offsets) of the same batches
    for b in batches:
        items = []
        for t in range(len(tables)):
            ids, lengths = b.table_values(t)
            items.append((ids, torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)[:-1]])))
        per_table.append(items)

    def fused(i: int) -> None:
        b = batches[i % len(batches)]
        tbe(b.values, b.offsets()).sum().backward()

    def baseline(kind: str):
        def step(i: int) -> None:
            opts[kind].zero_grad(set_to_none=True)
            outs = [bag(ids, offs) for bag, (ids, offs) in zip(bags[kind], per_table[i % len(per_table)])]
            torch.cat(outs, dim=1).sum().backward()
            opts[kind].step()
        return step

    methods = {"fused": fused, "bag_sparse": baseline("bag_sparse"), "bag_dense": baseline("bag_dense")}

    def timed(fn) -> float:
        t0 = time.perf_counter()
        for i in range(a.iters):
            fn(i)
        return (time.perf_counter() - t0) * 1e3 / a.iters

    for fn in methods.values():
        fn(0)  # warm up
    rounds: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(a.rounds):
        for k, fn in methods.items():
            rounds[k].append(timed(fn))
    best = {k: min(v) for k, v in rounds.items()}
    lookups = int(batches[0].lengths.sum())
    result = {"bench": "embedding_fused_vs_embeddingbag", "model": a.model, "tables": len(tables),
              "rows": sum(t.num_embeddings for t in tables), "batch": a.batch, "lookups_per_batch": lookups,
              "threads": a.threads, "optimizer": a.optimizer, "ms_fastest_round": best,
              "speedup_vs_bag_sparse": best["bag_sparse"] / best["fused"],
              "speedup_vs_bag_dense": best["bag_dense"] / best["fused"],
              "speedup_vs_bag_sparse_median": statistics.median(
                  s / f for f, s in zip(rounds["fused"], rounds["bag_sparse"])),
              "speedup_vs_bag_dense_median": statistics.median(
                  s / f for f, s in zip(rounds["fused"], rounds["bag_dense"])),
              "fused_lookups_per_s": lookups / best["fused"] * 1e3, "rounds_ms": rounds}
    emit(result, a.out)
    if a.record:
        record_results(f"Fused embedding vs nn.EmbeddingBag ({a.model}, {a.optimizer})", "\n".join([
            f"{len(tables)} tables ({result['rows']:,} rows, capped at {a.rows_cap:,}), batch {a.batch}, "
            f"{a.threads} thread(s), forward + backward + update, fastest of {a.rounds} rounds:", "",
            "| method | ms |", "|---|---|",
            *(f"| {k} | {v:.2f} |" for k, v in best.items()), "",
            f"fused vs EmbeddingBag with sparse gradients x{result['speedup_vs_bag_sparse']:.2f}, "
            f"with dense gradients x{result['speedup_vs_bag_dense']:.2f}."]))


if __name__ == "__main__":
    main()
