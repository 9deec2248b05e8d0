"""`eagle_hf.programs`: a program launched eagerly or compiled is the same arithmetic. A compiled launch checks only
its arguments' tensors, numbers and the global state; what its modules hold is read when the program is made
(`programs.signature`): programs over modules that differ in it never share a graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle_hf import programs

pytestmark = pytest.mark.usefixtures("one_thread")


class Doubling(nn.Module):
    """A module whose arithmetic follows a setting held outside its tensors (as a drafter's configuration)."""

    def __init__(self, doubles: bool):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.doubles = doubles


def doubled(module: Doubling, x: torch.Tensor, out: torch.Tensor, shift: int) -> torch.Tensor:
    y = module.linear(x)  # [2, 4]
    out.copy_((2 * y if module.doubles else y) + shift)
    return out


def test_compiled_programs_follow_their_modules_settings_and_numbers():
    torch.manual_seed(0)
    plain, doubling = Doubling(False), Doubling(True)
    doubling.linear.load_state_dict(plain.linear.state_dict())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for module, shift in ((plain, 0), (doubling, 0), (plain, 3)):
            out = torch.zeros(2, 4)
            launched = programs.Program(doubled, (x, out, shift), "compile")
            want = doubled(module, x, torch.zeros(2, 4), shift)
            for _ in range(2):  # (the first launch compiles, the second runs the compiled graph)
                torch.testing.assert_close(launched(module).clone(), want)
            assert launched.how == "compile"


def test_a_signature_reads_what_modules_hold():
    a, b = Doubling(False), Doubling(False)
    x = torch.zeros(2, 4)
    assert programs.signature((a,), (x, 1)) == programs.signature((b,), (x, 1))
    b.doubles = True
    assert programs.signature((a,), (x, 1)) != programs.signature((b,), (x, 1))
    assert programs.signature((a,), (x, 1)) != programs.signature((a,), (x, 2))
    assert programs.signature((a,), (x, 1)) != programs.signature((a.to(torch.float64),), (x, 1))
    handle = a.linear.register_forward_hook(lambda *args: None)
    assert programs.signature((a,), (x, 1)) != programs.signature((Doubling(False),), (x, 1))
    handle.remove()


def test_a_function_compiles_a_bounded_number_of_graphs(monkeypatch):
    """Past `RECOMPILE_ROOM` signatures of one function (a long-lived process meeting many shapes), later programs
    run eagerly, the same arithmetic."""
    monkeypatch.setattr(programs, "RECOMPILE_ROOM", 0)
    module, x = Doubling(True), torch.randn(2, 4)
    launched = programs.Program(doubled, (x, torch.zeros(2, 4), 1), "compile")
    with torch.no_grad():
        torch.testing.assert_close(launched(module), doubled(module, x, torch.zeros(2, 4), 1))
    assert launched.how == "eager"


def test_a_compiled_launch_skips_torch_compile_s_entry_while_the_global_state_holds():
    """A compiled program's later launches run the code torch.compile made for its graph directly (no entry: no
    guard lookup) while the global state is the one it was compiled in; under another (deterministic algorithms) its guarded entry
    compiles the graph for that state. The same arithmetic either way."""
    module, x = Doubling(True), torch.randn(2, 4)
    want = doubled(module, x, torch.zeros(2, 4), 1).detach()
    launched = programs.Program(doubled, (x, torch.zeros(2, 4), 2), "compile")  # (a signature of its own)
    with torch.no_grad():
        launched(module)  # (compiles)
    entered = []
    guarded = launched._run.guarded
    launched._run.guarded = lambda *args: (entered.append(1), guarded(*args))[1]
    with torch.no_grad():
        torch.testing.assert_close(launched(module).clone(), want + 1)
    assert not entered and launched.how == "compile"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            torch.testing.assert_close(launched(module).clone(), want + 1)
    finally:
        torch.use_deterministic_algorithms(False)
        launched._run.guarded = guarded
    assert entered and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
