"""The decode GEMM shapes of the shipped specs and the GPU tests' cases, shared by the
compile-only tests, the GPU tests and bench/precompile.py (no torch import here)."""

# (K, N, epilogue): Kimi K3 (hidden 7168) and tiny.yaml (hidden 1024, intermediate 2816).
BIG_SHAPES = [
    (7168, 36864, "silu_mul"),   # gate_up
    (18432, 7168, None),         # down
    (7168, 10240, None),         # qkv
    (8192, 7168, None),          # o_proj
]
TINY_SHAPES = [
    (1024, 1536, None),
    (1024, 5632, "silu_mul"),
    (2816, 1024, None),
    (1024, 1024, None),
]
SPEC_SHAPES = BIG_SHAPES + TINY_SHAPES

ALL_M = [1, 3, 8, 64, 256]
BIG_M = [1, 8, 64, 256]     # compiling is the slow part: the big shapes skip M = 3


def reference_cases():
    """(M, K, N, epilogue) of test_gemm_gpu.test_matches_fp32_reference."""
    for k, n, epi in TINY_SHAPES:
        for m in ALL_M:
            yield m, k, n, epi
    for k, n, epi in BIG_SHAPES:
        for m in BIG_M:
            yield m, k, n, epi
    # Two consumer warpgroups with a padded second half; N not a multiple of 128.
    yield 200, 1024, 5632, "silu_mul"
    yield 129, 1024, 1024, None
    yield 5, 128, 192, None


# The benchmark's tuning variants (bench/gemm.py), each with its reference check.
TUNING_CASES = [
    (1, 7168, 36864, "silu_mul", dict(block_k=128)),
    (64, 18432, 7168, None, dict(block_k=128)),
    (256, 1024, 5632, "silu_mul", dict(block_k=128)),
    (3, 2816, 1024, None, dict(block_k=128)),
    (64, 18432, 7168, None, dict(row_wgs=2)),           # 256-row tiles on a 28-tile problem
    (5, 1024, 5632, "silu_mul", dict(row_wgs=2)),
    (32, 1024, 36864, None, dict()),                   # row_wgs = 2 by default, plain
    (64, 7168, 36864, "silu_mul", dict(row_wgs=1, block_k=128)),
    # y through shared memory (the default from M = 49) against y from the fragments.
    (64, 8192, 7168, None, dict(y_staging=0)),
    (8, 1024, 5632, "silu_mul", dict(y_staging=1)),
    (128, 8192, 7168, None, dict(halves=2)),          # the second output half in the x buffer
    (128, 8192, 7168, None, dict(wide=0)),            # a 64-row half per warpgroup (65-200 rows)
    (200, 7168, 10240, None, dict(wide=0)),           # ... N = 208: a short last reduction chunk
    (129, 1024, 1536, None, dict(wide=0)),
    (128, 1024, 5632, "silu_mul", dict()),
    (64, 1024, 1024, None, dict(halves=1)),           # 64-row units: one output half
    (200, 1024, 5632, "silu_mul", dict(y_staging=0)),  # two batch warpgroups, direct stores
    # Registers moved to the consumers (consumer_regs: a producer warpgroup, setmaxnreg):
    # 256-row tiles of 192 and 160 batch columns (192 / 160 accumulators per thread, split
    # tiles summed from the workspace; up to 5 CTAs per tile), W in blocks, one consumer
    # warpgroup, silu_mul.
    (192, 7168, 10240, None, dict(wide=0, halves=2, row_wgs=2, col_wgs=1, consumer_regs=232, w_blocked=1)),
    (192, 7168, 10240, None, dict(wide=0, halves=2, row_wgs=2, col_wgs=1, consumer_regs=232, max_split=5)),
    (160, 1024, 4096, None, dict(wide=0, halves=2, row_wgs=2, col_wgs=1, consumer_regs=232)),
    (144, 1024, 1536, None, dict(wide=0, halves=2, row_wgs=1, col_wgs=1, consumer_regs=240)),
    (64, 1024, 5632, "silu_mul", dict(consumer_regs=232)),
    # The split-tile fix-up shared out by warpgroup (fixup_split): qkv at 192 rows (two CTAs
    # end in 52 of its 80 tiles), at 160 on W's blocks, up to three late CTAs in a 4-CTA tile,
    # one warpgroup with y held in a stage, silu_mul, tiles of two CTAs (one owner).
    (192, 7168, 10240, None, dict(fixup_split=1)),
    (160, 7168, 10240, None, dict(fixup_split=1, w_blocked=1)),
    (96, 1024, 4096, None, dict(fixup_split=1)),
    (64, 8192, 7168, None, dict(fixup_split=1, publish_first=0)),
    (128, 1024, 5632, "silu_mul", dict(fixup_split=1)),
    (192, 7168, 36864, None, dict(fixup_split=1)),
    # The split-tile protocol that is not the default there: publish first (every
    # contributor writes its partial, then arrives) from 32 rows and on gate_up, arrive first
    # at <= 16 rows on the few-tile shapes; bulk-copied partials, register sums, rounds.
    (8, 8192, 7168, None, dict(publish_first=0)),
    (1, 1024, 1024, None, dict(publish_first=0)),
    (64, 7168, 36864, "silu_mul", dict(publish_first=1)),
    (256, 7168, 10240, None, dict(publish_first=1)),
    # Only some of the prologue's stages load W before the PDL wait.
    (8, 8192, 7168, None, dict(pre_wait_stages=3)),
    (64, 7168, 36864, "silu_mul", dict(pre_wait_stages=0)),
    # The trigger moved later (the dependents launch later; the result is the same).
    (8, 8192, 7168, None, dict(trigger_at=1)),
    (64, 7168, 36864, "silu_mul", dict(trigger_at=2)),
    (3, 18432, 7168, None, dict(trigger_at=3)),
    # W in 8 KB blocks (kernels/weight_blocks.py; the test passes them as the 4-D weight):
    # 4-D W boxes over the same logical [N, K].
    (8, 8192, 7168, None, dict(w_blocked=1)),
    (64, 7168, 36864, "silu_mul", dict(w_blocked=1)),
    (37, 1024, 1536, None, dict(w_blocked=1)),
    (32, 8192, 7168, None, dict(w_blocked=1, block_k=128)),   # two blocks per box (3-D)
    # Whole-K tiles (kernels/gemm_wide.py), the default for plain shapes at 128 and 231-256
    # rows when one wave of tiles fills the SMs: 64-row batch tiles, several tiles per CTA
    # (a persistent loop), a padded batch tile, forced at few rows, a shallow pipeline, pairs
    # of CTAs sharing W, x boxes moved back from past row M; and the stream-K kernel where the
    # whole-K one is the default.
    (128, 8192, 7168, None, dict(wide=1)),
    (200, 1024, 4096, None, dict(wide=1, n_tile=16)),
    (256, 1024, 4096, None, dict(wide=1, batch_tile=64, n_tile=32)),
    (8, 8192, 7168, None, dict(wide=1)),              # x boxes of 16 rows (x_trim)
    (8, 8192, 7168, None, dict(wide=1, x_trim=0)),    # ... of 64, 56 rows zero-filled
    (40, 7168, 10240, None, dict(wide=1)),            # ... of 48
    (32, 8192, 7168, None, dict(wide=1)),             # ... of 32
    (1, 1024, 1024, None, dict(wide=1)),
    (3, 2816, 1024, None, dict(wide=1, batch_tile=128, n_tile=64)),
    (256, 8192, 7168, None, dict(wide=1, stages=3)),
    (256, 8192, 7168, None, dict(wide=1, cluster=1)),  # no W multicast in pairs of CTAs
    (256, 8192, 7168, None, dict(wide=1, static_stages=1)),   # stages constant: 21 rounds of 6 + 2 (§55)
    (256, 7168, 10240, None, dict(wide=1, static_stages=1, w_blocked=1)),   # qkv's 128 x 160 on blocks, 22 x 5 + 2
    (200, 512, 2048, None, dict(wide=1, n_tile=32, static_stages=1, stages=10)),    # fewer k-blocks than stages: no round
    (200, 1024, 4096, None, dict(wide=1, n_tile=16, cluster=1)),
    (160, 8192, 7168, None, dict(wide=1)),            # x boxes moved back from past row M
    (120, 7168, 10240, None, dict()),                 # ... in one 128-row batch tile (the default)
    (70, 1024, 1024, None, dict(wide=1, batch_tile=128)),
    # One batch tile: pairs of neighbouring W tiles share x (the default over several waves),
    # zero-filled rows past M in one CTA's half of the box, one tile per CTA.
    (64, 7168, 10240, None, dict(wide=1, cluster=2)),
    (32, 8192, 7168, None, dict(wide=1, cluster=2)),
    (64, 1024, 36864, None, dict(wide=1, n_tile=64)),
    (128, 7168, 10240, None, dict(wide=1, cluster=2)),
    # Whole-K tiles on W's blocks, loaded in 16-row pieces (2 KB each, from any row of a
    # block): pieces shared by a pair (7, an odd number, split even / odd), one piece per
    # tile, a tile straddling blocks (80 rows from row 80), several tiles per CTA, x pairs.
    (256, 8192, 7168, None, dict(wide=1, w_blocked=1)),
    (200, 1024, 4096, None, dict(wide=1, n_tile=16, w_blocked=1)),
    (128, 7168, 10240, None, dict(wide=1, w_blocked=1)),
    (3, 2816, 1024, None, dict(wide=1, batch_tile=128, n_tile=64, w_blocked=1)),
    (64, 1024, 36864, None, dict(wide=1, n_tile=64, cluster=2, w_blocked=1)),
    (160, 8192, 7168, None, dict(wide=1, w_blocked=1)),
    (8, 8192, 7168, None, dict(wide=1, w_blocked=1)),
    # 16-row blocks (a measurement variant, w_block_rows=16): a 64-row box is four blocks
    # (stream-K, also with two k-blocks per box), a 16-row piece one block (whole-K tiles).
    (8, 8192, 7168, None, dict(w_blocked=1, w_block_rows=16)),
    (64, 7168, 36864, "silu_mul", dict(w_blocked=1, w_block_rows=16)),
    (32, 8192, 7168, None, dict(w_blocked=1, w_block_rows=16, block_k=128)),
    (256, 8192, 7168, None, dict(wide=1, w_blocked=1, w_block_rows=16)),
    (128, 7168, 10240, None, dict(wide=1, w_blocked=1, w_block_rows=16)),    # one 4-D box per stage
    # ... and in a pair sharing W one box of half the tile's blocks per CTA: 10 blocks as 5 + 5,
    # 7 as 4 + 4 overlapping by one (also over several tiles per CTA), 3 as 2 + 2, and 5 as
    # pieces (3 blocks do not tile N's 20).
    (256, 7168, 10240, None, dict(wide=1, w_blocked=1, w_block_rows=16)),
    (256, 1024, 14336, None, dict(wide=1, n_tile=112, w_blocked=1, w_block_rows=16)),
    (256, 1024, 3072, None, dict(wide=1, n_tile=48, w_blocked=1, w_block_rows=16)),
    (256, 1024, 320, None, dict(wide=1, n_tile=80, w_blocked=1, w_block_rows=16)),
    (128, 18432, 7168, None, dict(wide=1, cluster=1, w_blocked=1, w_block_rows=16)),
    (64, 1024, 36864, None, dict(wide=1, n_tile=64, w_blocked=1, w_block_rows=16)),
    # Clusters of four (2 x 2 tiles): W shared by the pair of batch tiles, x by the pair of W
    # tiles: one tile per CTA, several (x boxes moved back), W in pieces of blocks, 16-row
    # blocks in half boxes, silu_mul's gate and up boxes.
    (256, 8192, 7168, None, dict(wide=1, cluster=4)),
    (200, 1024, 4096, None, dict(wide=1, n_tile=16, cluster=4)),
    (256, 7168, 10240, None, dict(wide=1, cluster=4, w_blocked=1)),
    (256, 7168, 10240, None, dict(wide=1, cluster=4, w_blocked=1, w_block_rows=16)),
    (256, 7168, 36864, "silu_mul", dict(wide=1, cluster=4)),
    # x shared by four neighbouring W tiles, with any number of batch tiles: cuBLAS's 4 x 1
    # cluster at qkv 192 rows (three batch tiles of 64), two batch tiles of 128, several tiles
    # per CTA with boxes moved back from past row M, and W pairs with x pairs over four batch
    # tiles.
    (192, 7168, 10240, None, dict(wide=1, batch_tile=64, n_tile=256, cluster=4)),
    (256, 7168, 10240, None, dict(wide=1, cluster=4, x_group=4)),
    (200, 1024, 4096, None, dict(wide=1, n_tile=16, cluster=4, x_group=4)),
    (150, 8192, 7168, None, dict(wide=1, batch_tile=64, cluster=2)),
    (256, 1024, 4096, None, dict(wide=1, batch_tile=64, n_tile=32, cluster=4)),
    # W shared by three batch tiles (64-row tiles at 129-192 rows; §46): cuBLAS's tile at qkv
    # 192 rows, several tiles per CTA with a box moved back past row M; four batch tiles.
    (192, 7168, 10240, None, dict(wide=1, batch_tile=64, n_tile=256, cluster=3, w_blocked=1)),
    (150, 1024, 4096, None, dict(wide=1, batch_tile=64, n_tile=16, cluster=3, w_blocked=1)),
    (256, 1024, 4096, None, dict(wide=1, batch_tile=64, n_tile=32, cluster=4, x_group=1, w_blocked=1)),
    # silu_mul on the whole-K tiles (gate and up rows as two boxes into one stage, the
    # epilogue pairing accumulator j with j + n_tile / 4): W pairs, x pairs over several
    # waves, 64-row blocks in pieces, 16-row blocks, a moved-back batch tile, few rows.
    (256, 7168, 36864, "silu_mul", dict(wide=1)),
    (128, 7168, 36864, "silu_mul", dict(wide=1)),
    (128, 7168, 36864, "silu_mul", dict(wide=1, w_blocked=1)),
    (256, 7168, 36864, "silu_mul", dict(wide=1, w_blocked=1, w_block_rows=16)),
    (200, 1024, 5632, "silu_mul", dict(wide=1)),
    (3, 1024, 5632, "silu_mul", dict(wide=1, cluster=1)),
    (256, 1024, 5632, "silu_mul", dict(wide=1, cluster=1, n_tile=64, w_blocked=1)),
    # plan's own choice on blocks: stream-K where the 80- / 112-row whole-K tiles would run on
    # rows, the whole-K tiles where theirs are 160 rows.
    (128, 7168, 10240, None, dict(w_blocked=1)),
    (256, 8192, 7168, None, dict(w_blocked=1)),
    (256, 7168, 10240, None, dict(w_blocked=1)),
    (256, 8192, 7168, None, dict(wide=0)),            # one 64-row unit per CTA, mma_n 256
    (256, 7168, 10240, None, dict(wide=0)),
    # One 64-row unit per CTA over the whole of K (the stream-K kernel's default for o_proj
    # and down at 129-230 rows, and for o_proj at 65-128), a padded batch column block, y
    # staged in the x buffer.
    (160, 8192, 7168, None, dict()),
    (137, 18432, 7168, None, dict()),
    (72, 8192, 7168, None, dict()),                   # (x in two boxes: 64 + 8 rows)
    (128, 8192, 7168, None, dict()),
    # x boxes trimmed to round_up(M, 8) rows (two boxes per buffer), against one box.
    (120, 8192, 7168, None, dict()),
    (120, 8192, 7168, None, dict(x_trim=0)),
    (20, 7168, 10240, None, dict()),
    (40, 1024, 5632, "silu_mul", dict()),
    (200, 1024, 1024, None, dict()),                  # two 64-row units side by side
    (136, 18432, 7168, None, dict()),
    # ... with x shared by clusters of 2 or 4 CTAs (multicast slices of every x box).
    (160, 8192, 7168, None, dict(cluster=4)),
    (137, 18432, 7168, None, dict(cluster=2)),
    (208, 8192, 7168, None, dict(cluster=2)),
    # static_stages (both k-block loops unrolled by the stage count) with x shared by a pair
    # instead of W, and with the silu_mul epilogue on trimmed x boxes and 16 stages.
    (64, 8192, 7168, None, dict(wide=1, cluster=2, static_stages=1)),
    (40, 1024, 4096, "silu_mul", dict(wide=1, static_stages=1)),
    # ... over several tiles per CTA, each tile whole rounds (16 k-blocks on 4 stages): 1-2
    # tiles per CTA with x pairs, 3-4 with W pairs, and silu_mul on 100 rows (x boxes moved back).
    (128, 1024, 51200, None, dict(wide=1, n_tile=256, stages=4, static_stages=1)),
    (256, 1024, 40960, None, dict(wide=1, n_tile=160, stages=4, static_stages=1)),
    (100, 1024, 36864, "silu_mul", dict(wide=1, stages=4, static_stages=1)),
    # wg_release (one release per consumer warpgroup and CTA): W pairs, x pairs over several
    # tiles per CTA with stages constant, and no cluster with silu_mul.
    (256, 8192, 7168, None, dict(wide=1, wg_release=1)),
    (128, 1024, 51200, None, dict(wide=1, n_tile=256, stages=4, static_stages=1, wg_release=1)),
    (200, 1024, 5632, "silu_mul", dict(wide=1, cluster=1, wg_release=1)),
]

# Shapes of test_gemm_gpu's other tests (graph replay, chains, races, stream), listed for
# bench/precompile.py; keep in step with the tests.
OTHER_CASES = [
    (8, 7168, 10240, None), (8, 1024, 5632, "silu_mul"), (8, 18432, 7168, None),
    (64, 7168, 36864, "silu_mul"), (1, 1024, 1024, None), (256, 8192, 7168, None),
    (8, 8192, 7168, None), (64, 1024, 5632, "silu_mul"),
]
