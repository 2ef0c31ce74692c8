"""kernels/workspaces.py: whose scratch memory a split-K launch gets (no GPU needed)."""

import torch

from graphc.kernels.workspaces import SHARED, Workspaces, workspace


def make():
    return (torch.zeros(4), torch.zeros(2, dtype=torch.int32))


def test_an_owners_first_request_is_served_from_its_own_workspaces():
    """An owner with nothing in it yet is still the owner: its first request must not fall
    through to the shared workspaces (a truth test of an empty owner once did)."""
    owner = Workspaces()
    before = len(SHARED.of("toy"))
    mine = workspace(owner, ("toy", 0, "cfg"), make, "toy")
    assert len(owner.of("toy")) == 1 and owner.of("toy")[0] is mine and len(SHARED.of("toy")) == before
    assert workspace(owner, ("toy", 0, "cfg"), make, "toy") is mine     # allocated once
    assert owner.nbytes() == 4 * 4 + 2 * 4


def test_two_owners_never_share_and_no_owner_means_the_shared_ones():
    first, second = Workspaces(), Workspaces()
    key = ("toy", 0, "two owners")
    a, b = workspace(first, key, make, "toy"), workspace(second, key, make, "toy")
    assert a[0].data_ptr() != b[0].data_ptr() and a[1].data_ptr() != b[1].data_ptr()
    shared = workspace(None, key, make, "toy")
    assert shared is SHARED.get(key, make, "toy") and shared is not a and shared is not b


def test_of_lists_one_kernels_workspaces():
    owner = Workspaces()
    gemm = workspace(owner, ("gemm", 0, 1), make, "gemm")
    workspace(owner, ("attention_tma", 0, 1), make, "attention")
    assert len(owner.of("gemm")) == 1 and owner.of("gemm")[0] is gemm
