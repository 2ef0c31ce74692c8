"""How many thread-block clusters of each size this GPU runs at once for a kernel of the
decode GEMM's footprint: one CTA per SM (its shared-memory ring), as the driver's
``cuOccupancyMaxActiveClusters`` reports it.

    source .gpu/setup.sh && python3 bench/cluster_occupancy.py [--smem BYTES] [--threads N]

A cluster's CTAs must all sit in one GPC, and a persistent grid of more clusters than fit at
once runs its last ones as a second wave (bench/gemm_notes.md §42, §47). Whether the clusters
of a configuration all co-reside is a property of the board, not of the plan, so it is asked
here of the driver, with a kernel that does nothing but has the footprint that matters (the
dynamic shared memory that leaves room for one CTA per SM, and the thread count).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graphc.kernels.smem_pipeline import SMEM_BUDGET  # noqa: E402

# An empty kernel: occupancy depends on the launch's footprint, not on what the kernel does.
PROBE_PTX = b""".version 8.0
.target sm_90a
.address_size 64
.visible .entry graphc_cluster_probe() { ret; }
"""
MAX_PORTABLE_CLUSTER = 8


def _check(result):
    """The value of a cuda-bindings call's (CUresult, value...) tuple; raises on an error."""
    from cuda.bindings import driver
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver: {err.name}")
    return values[0] if values else None


def probe_function(smem: int):
    """The empty kernel, loaded into the current context, allowed ``smem`` dynamic bytes."""
    from cuda.bindings import driver
    torch.zeros(1, device="cuda")       # makes torch's (primary) context current
    module = _check(driver.cuModuleLoadData(PROBE_PTX))
    function = _check(driver.cuModuleGetFunction(module, b"graphc_cluster_probe"))
    _check(driver.cuFuncSetAttribute(
        function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    return function


def max_active_clusters(function, cluster: int, smem: int, threads: int) -> int:
    """Clusters of ``cluster`` CTAs (``threads`` each, ``smem`` dynamic shared bytes) resident
    at once on the whole GPU."""
    from cuda.bindings import driver
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster, 1, 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster * torch.cuda.get_device_properties(0).multi_processor_count, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem
    config.attrs, config.numAttrs = [attribute], 1
    return int(_check(driver.cuOccupancyMaxActiveClusters(function, config)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smem", type=int, default=SMEM_BUDGET,
                    help=f"dynamic shared memory per CTA in bytes (default {SMEM_BUDGET}: the GEMMs' ring budget)")
    ap.add_argument("--threads", type=int, default=160, help="threads per CTA (default 160: one consumer warpgroup and the producer warp)")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    function = probe_function(args.smem)
    print(f"{props.name}, {props.multi_processor_count} SMs; CTAs of {args.threads} threads and "
          f"{args.smem} bytes of dynamic shared memory")
    print("cluster  max active clusters  CTAs at once  SMs left idle")
    for cluster in range(1, MAX_PORTABLE_CLUSTER + 1):
        clusters = max_active_clusters(function, cluster, args.smem, args.threads)
        ctas = clusters * cluster
        print(f"{cluster:7d}  {clusters:19d}  {ctas:12d}  {props.multi_processor_count - ctas:13d}")


if __name__ == "__main__":
    main()
