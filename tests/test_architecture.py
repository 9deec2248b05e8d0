"""The speculation round's shape: how much drafting pays is one concept in three modules (what is measured, what it
predicts, what the round is told), the schedule asks whether its rows are a batch in one place, and no class that
behaves (a dataclass record aside) holds more than 12 instance attributes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECULATION = ROOT / "eagle_hf" / "speculation"
MOST_ATTRIBUTES = 12


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "dataclass"
               or isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "dataclass"
               for d in cls.decorator_list)


def instance_attributes(cls: ast.ClassDef) -> set[str]:
    """The names a class's methods assign as ``self.<name> = ...`` (``+=`` and annotated assignments too)."""
    names = set()
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for e in ast.walk(target):
                if (isinstance(e, ast.Attribute) and isinstance(e.ctx, ast.Store) and isinstance(e.value, ast.Name)
                        and e.value.id == "self"):
                    names.add(e.attr)
    return names


def behaviour_classes() -> dict[str, set[str]]:
    """Each class of eagle_hf/speculation that is not a dataclass, by ``module.Class``: its instance attributes."""
    out = {}
    for path in sorted(SPECULATION.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not _is_dataclass(node):
                out[f"{path.stem}.{node.name}"] = instance_attributes(node)
    return out


def test_the_attribute_count_sees_assignments_in_every_method():
    cls = ast.parse("class A:\n    def __init__(self):\n        self.a, self.b = 1, 2\n        self.c: int = 3\n"
                    "    def step(self):\n        self.d += 1\n        self.a = 0\n        other.e = 1\n").body[0]
    assert instance_attributes(cls) == {"a", "b", "c", "d"}


def test_no_behaviour_class_in_speculation_holds_more_than_12_attributes():
    classes = behaviour_classes()
    assert {"schedule.DraftLengthController", "speculator.Speculator", "schedule.BatchPlan"} <= set(classes)
    over = {name: sorted(attrs) for name, attrs in classes.items() if len(attrs) > MOST_ATTRIBUTES}
    assert not over, over


def test_the_schedule_asks_whether_its_rows_are_a_batch_in_one_place():
    """What a batch decides otherwise than a single row hangs on `DraftLengthController.batched` alone: no other
    test of the rows in the schedule, and no module of the schedule's besides `costs`, `schedule` and `rounds` (the round's plan)."""
    found = [f"{p.name}:{n}" for p in sorted(SPECULATION.glob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bself\.batch\b|rows\s*>\s*1", line)]
    assert found == [f"schedule.py:{_line_of('schedule.py', 'return self.costs.rows > 1')}"], found
    gone = {"acceptance", "backoff", "batch_plan", "cost_model", "loss_budget", "policy", "round_costs"}
    assert not gone & {p.stem for p in SPECULATION.glob("*.py")}


def test_a_round_reads_few_modules():
    """A round's plan and record are one module (`rounds`), its drafting one (`drafting`: the drafter's cache, the
    growth, the layout and the programs that launch them, with their kept storage), its host-to-device copies live
    with the programs that read them (`eagle_hf.programs`), and eagle_hf/speculation holds at most 15 modules."""
    stems = {p.stem for p in SPECULATION.glob("*.py")}
    assert not {"round_plan", "transfer", "draft_programs"} & stems
    assert not (ROOT / "eagle_hf" / "drafter" / "graphs.py").exists()
    assert len(stems) <= 15, sorted(stems)


def _line_of(name: str, text: str) -> int:
    return next(n for n, line in enumerate((SPECULATION / name).read_text().splitlines(), 1) if text in line)


def _calls(method: str, on: str | None = None) -> set[str]:
    """The modules of eagle_hf (by path under eagle_hf/) that call ``<something>.<method>(...)`` (``<on>.<method>``
    where `on` is given)."""
    out = set()
    for path in sorted((ROOT / "eagle_hf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
                    and (on is None or isinstance(node.func.value, ast.Name) and node.func.value.id == on)):
                out.add(path.relative_to(ROOT / "eagle_hf").as_posix())
    return out


def _constructed(name: str) -> set[str]:
    return {path.relative_to(ROOT / "eagle_hf").as_posix() for path in sorted((ROOT / "eagle_hf").rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name}


def test_only_the_round_plan_decides_and_only_the_round_record_reports():
    """The round's seams: the schedule's choice and the copy source's proposal are asked for by the round plan
    alone, which cuts the copy branches to a static cache's room before anything runs; a round's outcome is one `RoundRecord`, made by the speculator's `end_round`, which both loops call;
    a round's timings reach the schedule through `report_round` alone."""
    assert _calls("choose", on="controller") == {"speculation/speculator.py"}
    assert _calls("propose") == {"speculation/speculator.py"}
    assert set(_callers("cut_branches")) == {"speculation/speculator.plan_round"}  # copy branches cut to a static cache's room
    assert _constructed("RoundRecord") == {"speculation/speculator.py"}
    assert _calls("end_round") == {"hf/tree_loop.py", "hf/candidate.py"}
    assert _calls("observe") <= {"speculation/rounds.py", "speculation/schedule.py"}


def _callers(name: str) -> dict[str, int]:
    """Where eagle_hf calls ``name(...)`` (a plain or attribute call), by ``module.function``: how often."""
    out: dict[str, int] = {}
    for path in sorted((ROOT / "eagle_hf").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == name
                                                    or getattr(node.func, "attr", None) == name):
                    key = f"{path.relative_to(ROOT / 'eagle_hf').with_suffix('')}.{fn.name}"
                    out[key] = out.get(key, 0) + 1
    return out


def test_growing_choosing_and_verifying_are_each_implemented_once():
    """A round's trees grow in one function (`grow_levels`, launched eagerly by `draft_trees` or as a program by
    `grow_trees`), their nodes are chosen in one (`tree_layout`, after `grow_levels` in the same two launches), and
    the target verifies them in one forward (`TreeLoop.verify`, for laid-out and host trees alike), and one function
    accepts (`accept_paths`, from `TreeLoop.accept`: greedy and sampling from the round's one read). The host's level-by-level growth
    and the node-by-node rejection sampling live in the tests only (`tests/reference_growth.py`,
    `tests/reference_acceptance.py`)."""
    launches = {"speculation/drafting.draft_trees", "speculation/drafting.grow_trees"}
    assert set(_callers("grow_levels")) == launches
    assert set(_callers("tree_layout")) == launches
    assert set(_callers("verify")) == {"hf/tree_loop.verify_and_commit"}
    assert set(_callers("accept_paths")) == {"hf/tree_loop.accept"}
    assert set(_callers("accept_greedy")) == set(_callers("accept_drawn")) == {"speculation/tree.accept_paths"}
    source = "\n".join(p.read_text() for p in (ROOT / "eagle_hf").rglob("*.py"))
    for gone in ("class Candidates", "def _select(", "def greedy_chain(", "class FixedLevel", "def read_choices(",
                 "def accept_sampling(", "q_logits"):
        assert gone not in source, gone


def test_the_tree_loop_reaches_the_round_through_its_steps():
    """The tree loop's round reaches eagle_hf/speculation through the modules of its steps alone: the plan and the
    report (`rounds`), the drafting step (`speculator.draft_round`: the drafting itself is behind it), the trees as
    the verify reads them (`drafting.PendingTrees`), the tree and its acceptance (`tree`), and the ragged rows its
    cache shares with the drafter's (`ragged`)."""
    tree = ast.parse((ROOT / "eagle_hf" / "hf" / "tree_loop.py").read_text())
    reached = {node.module.rsplit(".", 1)[-1] for node in ast.walk(tree)  # (`from ..speculation.<m> import`)
               if isinstance(node, ast.ImportFrom) and node.level == 2 and (node.module or "").startswith("speculation")}
    assert reached == {"drafting", "ragged", "rounds", "speculator", "tree"}, reached
