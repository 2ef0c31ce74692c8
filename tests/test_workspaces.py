"""kernels/workspaces.py: whose scratch memory a split-K launch gets (no GPU needed)."""

import pytest
import torch

import graphc.kernels.workspaces as ws_module
from graphc.kernels.workspaces import Workspaces, workspace


def make():
    return (torch.zeros(4), torch.zeros(2, dtype=torch.int32))


def toy() -> str:
    return "toy"


@pytest.fixture(autouse=True)
def fresh_shared(monkeypatch):
    """Each test sees an empty SHARED pool and leaves the process's own untouched."""
    monkeypatch.setattr(ws_module, "SHARED", Workspaces())
    return ws_module.SHARED


def test_an_owners_first_request_is_served_from_its_own_workspaces(fresh_shared):
    """An owner with nothing in it yet is still the owner: its first request must not fall
    through to the shared workspaces (a truth test of an empty owner once did)."""
    owner = Workspaces()
    mine = workspace(owner, ("toy", 0, "cfg"), make, toy)
    assert len(owner.of("toy")) == 1 and owner.of("toy")[0] is mine and fresh_shared.of("toy") == []
    assert workspace(owner, ("toy", 0, "cfg"), make, toy) is mine     # allocated once
    assert owner.nbytes() == 4 * 4 + 2 * 4


def test_two_owners_never_share_and_no_owner_means_the_shared_ones(fresh_shared):
    first, second = Workspaces(), Workspaces()
    key = ("toy", 0, "two owners")
    a, b = workspace(first, key, make, toy), workspace(second, key, make, toy)
    assert a[0].data_ptr() != b[0].data_ptr() and a[1].data_ptr() != b[1].data_ptr()
    shared = workspace(None, key, make, toy)
    assert shared is fresh_shared.get(key, make, toy) and shared is not a and shared is not b


def test_of_lists_one_kernels_workspaces():
    owner = Workspaces()
    gemm = workspace(owner, ("gemm", 0, 1), make, toy)
    workspace(owner, ("attention_tma", 0, 1), make, toy)
    assert len(owner.of("gemm")) == 1 and owner.of("gemm")[0] is gemm


def test_find_reads_without_allocating_and_the_description_is_built_only_for_an_error():
    """``find`` is for tools reading what a launch left (a miss must not hand them fresh zeros);
    ``what`` is a callable so an eager launch does not format its configuration every time."""
    owner = Workspaces()
    calls = []

    def what():
        calls.append(1)
        return "toy"

    assert owner.find(("toy", 0, "cfg")) is None and owner.nbytes() == 0
    made = workspace(owner, ("toy", 0, "cfg"), make, what)
    assert owner.find(("toy", 0, "cfg")) is made
    workspace(owner, ("toy", 0, "cfg"), make, what)
    assert calls == []          # outside a capture nothing asked for the description
