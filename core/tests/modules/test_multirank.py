"""Expert parallel over two CPU processes (gloo) against one rank holding every expert.

Each child process runs this file through ``runpy`` (its functions are then importable
whatever pytest's import mode), joins a gloo group through a FileStore, builds its half of
the experts with the process group, and compares its tokens' output with a single-rank
module over every rank's tokens. Routed experts only: bit for bit (every (token, top-k
slot) is served by one rank, so the reduce-scatter adds zeros only). With a fused shared
expert, computed by each rank for its own tokens, float32 GEMMs over different token counts
may round differently: within 1 bf16 ulp.
"""

from __future__ import annotations

import runpy
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bitcheck import assert_bitwise_equal

from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_expert_tensors

WORLD = 2
H, INTER = 256, 256
CKPT, RUN = WeightFormat.FP8_BLOCK, WeightFormat.MXFP8
WORKER_RUN_NAME = "__megamoe_multirank_worker__"
# Tokens per rank for successive forwards: uneven counts, and an idle rank.
TOKEN_COUNTS = ((5, 9), (0, 3), (7, 7))


def _build(
    group: dist.ProcessGroup | None, rank: int, shared: int, emulate: bool
) -> MegaMoEExperts:
    local = 8 // WORLD if group is not None else 8
    m = MegaMoEExperts(
        num_experts=8,
        num_local_experts=local,
        experts_start_idx=rank * local if group is not None else 0,
        num_logical_experts=6,
        top_k=3,
        hidden_size=H,
        intermediate_size=INTER,
        weight_format=RUN,
        checkpoint_format=CKPT,
        num_shared_experts=shared,
        max_num_tokens=32,
        process_group=group,
        backend="reference",
        prefix="ep",
        emulate_kernel=emulate,
    )
    m.load_weights(synthetic_expert_tensors(CKPT, 6, H, INTER, seed=0))
    if shared:
        for name, tensor in synthetic_expert_tensors(CKPT, 1, H, INTER, seed=5):
            _, proj, kind = name.split(".")
            m.load_shared_expert_tensor({"gate_proj": "w1", "up_proj": "w3"}.get(proj, "w2"), kind,
                                        tensor)  # fmt: skip
    m.finalize()
    return m


def _tokens(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(count, H, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(count, 8, generator=gen), dim=1)[:, :3]  # distinct per token
    ids[::4, 2] = -1
    return x, torch.rand(count, 3, generator=gen) + 0.1, ids


def _check_rank(rank: int) -> None:
    group = dist.group.WORLD
    assert group is not None
    for shared, emulate in ((0, False), (0, True), (1, True)):
        ep, one = _build(group, rank, shared, emulate), _build(None, 0, shared, emulate)
        for call, counts in enumerate(TOKEN_COUNTS):
            per_rank = [_tokens(c, seed=100 * call + r) for r, c in enumerate(counts)]
            mine = ep(*per_rank[rank])
            everything = [torch.cat(parts) for parts in zip(*per_rank, strict=True)]
            start = sum(counts[:rank])
            want = one(*everything)[start : start + counts[rank]]
            what = f"rank {rank}, shared={shared}, emulate={emulate}, tokens {counts}"
            if shared == 0:
                assert_bitwise_equal(mine, want, what)
            else:
                diff = (mine.double() - want.double()).abs()
                assert bool((diff <= 2.0**-8 * want.double().abs() + 1e-6).all()), what
    try:
        _build(group, 1 - rank, 0, False)  # the other rank's slice
    except ValueError as exc:
        assert f"rank {rank} of an expert-parallel group of 2 must hold" in str(exc)
    else:
        raise AssertionError("a slice that does not match the rank was accepted")


def _worker(rank: int, store: str, errors: str) -> None:
    """Child process body: join the group, check, report a failure to the parent."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        _check_rank(rank)
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_gloo_match_one_rank(tmp_path: Path):
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=runpy.run_path,
            args=(__file__,),
            kwargs={
                "run_name": WORKER_RUN_NAME,
                "init_globals": {"WORKER_ARGS": (rank, str(tmp_path / "store"), str(tmp_path))},
            },
        )
        for rank in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    reports = "\n".join(f.read_text() for f in sorted(tmp_path.glob("rank*.txt")))
    assert not hung, f"{len(hung)} rank(s) hung\n{reports}"
    assert [p.exitcode for p in procs] == [0] * WORLD, reports


if __name__ == WORKER_RUN_NAME:
    _worker(*globals()["WORKER_ARGS"])
