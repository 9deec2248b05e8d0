"""The drift diagnostic on tiny models: the attention hook, masses, shapes, bad input, and the CLI's files."""

import json

import pytest
import torch
from conftest import tiny_drafter

from eagle_hf.tools.diagnose import (
    CONDITIONS,
    DEPTH_QUANTITIES,
    MAX_DEPTH,
    SYSTEM_PROMPTS,
    DiagnoseError,
    diagnose,
    drift_markdown,
)

PROMPTS = ["w1 w2 w3 w4", "w5 w6", "w7 w8 w9"]


@pytest.fixture(scope="module")
def parts():
    from test_training import peaky_target, tiny_tokenizer

    torch.set_num_threads(1)
    target = peaky_target()
    target.name_or_path = "tiny"
    return target, tiny_tokenizer(), tiny_drafter(target)


def _run(parts, **kw):
    target, tok, drafter = parts
    settings = {"prompts": PROMPTS, "max_new_tokens": 14, "depth": 3, "long_context_tokens": 48, "progress": False}
    settings.update(kw)
    return diagnose(target, tok, drafter, **settings)


# ------------------------------------------------------------------------------------ the opt-in attention hook
@pytest.mark.parametrize("t,past,masked", [(1, 7, False), (5, 0, False), (3, 6, False), (2, 6, True)])
def test_recording_attention_leaves_outputs_bit_identical(t, past, masked):
    """Recording adds eager probabilities beside SDPA: the step's outputs are bit-identical, and probs @ V = SDPA."""
    from eagle_hf.drafter.modeling import KV, causal_mask

    drafter = tiny_drafter()
    dev = drafter.device
    drafter.bind_target_embedding(torch.nn.Embedding(96, 64).to(dev))
    g = torch.Generator().manual_seed(0)
    hidden, ids = torch.randn(1, t, 64, generator=g).to(dev), torch.randint(0, 96, (1, t), generator=g).to(dev)
    pos = torch.arange(past, past + t, device=dev)[None]
    cache = KV(torch.randn(1, 2, past, 16, generator=g).to(dev),
               torch.randn(1, 2, past, 16, generator=g).to(dev)) if past else None
    mask = None
    if masked:  # a tree-style mask: some past rows hidden
        mask = causal_mask(t, past, dev).clone()
        mask[..., 1] = False
    plain = drafter.step(hidden, ids, pos, past=cache, mask=mask)
    with drafter.recording_attention() as probs:
        recorded = drafter.step(hidden, ids, pos, past=cache, mask=mask)
    assert drafter.midlayer.self_attn.probs_record is None  # off again after the block
    assert torch.equal(plain.logits, recorded.logits) and torch.equal(plain.hidden, recorded.hidden)
    (p,) = probs
    assert p.shape == (1, 4, t, past + t) and p.dtype == torch.float32
    torch.testing.assert_close(p.sum(-1), torch.ones(1, 4, t, device=dev))
    if masked:
        assert float(p[..., 1].abs().max()) == 0.0
    # the probabilities reproduce the attention output: softmax(QK^T) V through o_proj equals the SDPA path
    attn = drafter.midlayer.self_attn
    layer = drafter.midlayer
    u = torch.cat([layer.input_layernorm(drafter.embed(ids)), layer.hidden_norm(hidden)], -1)  # [1, t, 2H]
    v = attn.v_proj(u).view(1, t, 2, 16).transpose(1, 2)  # [1, kvh, t, d]
    values = torch.cat([cache.values, v], 2) if cache else v
    eager = p @ values.repeat_interleave(2, dim=1)  # [1, h, t, d]
    with torch.no_grad():
        cos, sin = drafter.rotary(pos, hidden.dtype)
        sdpa, _ = attn(u, cos, sin, cache, mask)
    torch.testing.assert_close(attn.o_proj(eager.transpose(1, 2).reshape(1, t, -1)), sdpa, rtol=1e-4, atol=1e-5)


def test_recording_stops_after_an_exception():
    drafter = tiny_drafter()
    with pytest.raises(RuntimeError), drafter.recording_attention():
        raise RuntimeError("boom")
    assert drafter.midlayer.self_attn.probs_record is None


# ------------------------------------------------------------------------------------ the diagnostic
def test_attention_masses_sum_to_one_and_shapes(parts):
    report = _run(parts)
    data = report.to_dict()
    assert list(data["conditions"]) == list(CONDITIONS)
    for name, c in data["conditions"].items():
        assert c["runs"] == len(PROMPTS) and c["rounds"] > 0
        for q in DEPTH_QUANTITIES:
            assert len(c[q]) == 3, q
        for k in range(3):
            total = c["attention_sink"][k] + c["attention_context"][k] + c["attention_drafts"][k]
            assert total == pytest.approx(1.0, abs=1e-5), (name, k)
        assert c["attention_drafts"][0] == 0.0  # depth 1 reads only verified rows
        assert all(c["attention_drafts"][k] > 0 for k in (1, 2))
        assert c["reach"][0] == 1.0 and c["rounds_reaching"][0] == c["rounds"]
        assert all(a <= r for a, r in zip(c["accepted"], c["rounds_reaching"]))
        assert c["rounds_reaching"][1:] == c["accepted"][:-1]  # reaching depth k+1 = accepting depth k
        assert c["tau"] == pytest.approx(1 + sum(c["accepted"]) / c["rounds"])
        fused = c["fused_inputs"]
        assert len(fused["tap_norm"]) == 3 and len(fused["tap_norm_after_fc_norm"]) == 3 and fused["fc_norm_output"] > 0
        # EAGLE-3.1 feeds back norm(h): the fed-back norm is the RMSNorm's (unit weights: sqrt(H) = 8)
        assert c["fed_back_norm"][0] == pytest.approx(8.0, rel=1e-3)
    assert data["conditions"]["long"]["mean_context_tokens"] >= 48 + data["conditions"]["clean"]["mean_context_tokens"]
    assert [r["variant"] for r in data["runs"] if r["condition"] == "system"] == list(SYSTEM_PROMPTS)[: len(PROMPTS)]
    assert "| long | 3 |" in report.markdown()


def test_acceptance_matches_a_drafter_that_knows_the_target(parts):
    """Drafts equal to the target's own tokens: every depth reached and accepted (the bookkeeping, checked end to end)."""
    from eagle_hf.tools import diagnose as diag

    real = diag.draft_tree

    def oracle(drafter_, state, root, logits, hidden, depth, **kw):  # the target's next `depth` greedy tokens
        tree = real(drafter_, state, root, logits, hidden, depth=depth, **kw)
        path = oracle.tokens[0, state.length + 1 : state.length + 1 + depth]
        tree.tokens[1:] = path
        return tree

    def capture(*args, **kw):
        out = real_path(*args, **kw)
        oracle.tokens = out[0]
        return out

    real_path = diag.greedy_path
    try:
        diag.draft_tree, diag.greedy_path = oracle, capture
        c = _run(parts, conditions="clean").to_dict()["conditions"]["clean"]
    finally:
        diag.draft_tree, diag.greedy_path = real, real_path
    assert c["acceptance"] == [1.0, 1.0, 1.0] and c["reach"] == [1.0, 1.0, 1.0] and c["tau"] == 4.0


def test_system_prompts_all_runs_every_variant(parts):
    report = _run(parts, conditions=("system",), system_mode="all", prompts=PROMPTS[:1])
    assert [r["variant"] for r in report.runs] == list(SYSTEM_PROMPTS)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"conditions": "clean,noisy"}, "Unknown condition.*noisy.*clean, system, long"),
        ({"conditions": ()}, "valid conditions are clean, system, long"),
        ({"depth": 0}, f"depth must be an integer from 1 to {MAX_DEPTH}"),
        ({"depth": MAX_DEPTH + 1}, f"from 1 to {MAX_DEPTH}"),
        ({"depth": 5, "max_new_tokens": 5}, "use at least 6"),
        ({"sink_tokens": 0}, "sink_tokens must be a positive integer"),
        ({"system_mode": "some"}, "system_mode must be one of cycle, all"),
        ({"prompts": "no_such_set"}, "No prompt set 'no_such_set'.*mt_bench"),
        ({"long_context_tokens": 600}, "exceeds the target's context window of 512"),
    ],
)
def test_bad_input_fails_before_compute(parts, monkeypatch, kw, match):
    from eagle_hf.tools import diagnose as diag

    def boom(*a, **k):
        raise AssertionError("computed before the error")

    monkeypatch.setattr(diag, "greedy_path", boom)
    with pytest.raises(DiagnoseError, match=match):
        _run(parts, **kw)


def test_no_chat_template_is_a_clear_error(parts):
    from test_training import tiny_tokenizer

    target, _, drafter = parts
    with pytest.raises(DiagnoseError, match="no chat template"):
        diagnose(target, tiny_tokenizer(chat_template=None), drafter, prompts=PROMPTS, progress=False)


def test_cli_writes_table_json_and_pngs(parts, tmp_path, monkeypatch, capsys):
    from eagle_hf.cli import main
    from eagle_hf.drafter import default

    target, tok, drafter = parts
    monkeypatch.setattr(default, "load_target", lambda *a, **k: (target, tok))
    monkeypatch.setattr(default, "load_drafter", lambda *a, **k: (drafter, "tiny drafter"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(PROMPTS)))
    out = tmp_path / "out"
    rc = main(["diagnose", "--prompts", str(prompts), "--limit", "2", "--depth", "3", "--max-new-tokens", "12",
               "--long-context-tokens", "40", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| condition | depth |" in printed and "| system | 3 |" in printed and "tiny drafter" in printed
    data = json.loads((out / "drift.json").read_text())
    assert data["settings"]["depth"] == 3 and data["meta"]["prompts"] == 2
    assert (out / "drift.md").read_text().count("|") > 50
    assert drift_markdown(data) == (out / "drift.md").read_text()  # tables and plots are rebuilt from drift.json
    for name in [*DEPTH_QUANTITIES, "fused_inputs"]:
        assert (out / f"{name}.png").stat().st_size > 1000, name
    assert main(["diagnose", "--conditions", "clean,bogus", "--out", str(tmp_path / "x")]) == 2
    assert "valid conditions are clean, system, long" in capsys.readouterr().err


def test_shared_prefix_prefilled_once_gives_the_same_path(parts):
    """The long condition's shared news text is prefilled once: the same tokens and taps as a full prefill."""
    from eagle_hf.tools.diagnose import DiagnoseSettings, PrefixStore, build_runs, greedy_path

    target, tok, _ = parts
    settings = DiagnoseSettings(prompts=PROMPTS, conditions=("long", "clean"), long_context_tokens=80).validate()
    runs = build_runs(tok, [(str(i), t) for i, t in enumerate(PROMPTS)], settings)
    long = [r for r in runs if r.condition == "long"]
    assert all(r.shared >= 80 for r in long) and all(r.shared == 0 for r in runs if r.condition == "clean")
    store, ids = PrefixStore(), [2, 3, 3]
    for r in long:
        plain = greedy_path(target, r.input_ids, ids, 8, {2})
        reused = greedy_path(target, r.input_ids, ids, 8, {2}, r.shared, store)
        assert torch.equal(plain[0], reused[0])
        assert plain[1].shape == reused[1].shape == (1, plain[0].shape[1] - 1, 3 * 64)
        torch.testing.assert_close(plain[1], reused[1], rtol=1e-4, atol=1e-4)
    assert store.ids.shape[1] == long[0].shared


# ------------------------------------------------------------------------------------ drafters side by side
def test_drafters_replayed_over_the_same_paths_pair_up(parts, tmp_path):
    """Two drafters in one call: the target decodes each run once; a drafter equal to the reference differs by
    exactly 0 in every pair, an EAGLE-3 drafter (flags off) gets its own measurements; files are written."""
    from eagle_hf.tools.diagnose import diagnose_drafters
    from eagle_hf.tools.drift_comparison import compare, compare_markdown, save_comparison

    target, tok, drafter = parts
    eagle3 = tiny_drafter(target, seed=3, fc_norm=False, norm_output=False)
    reports = diagnose_drafters(target, tok, {"3.1": drafter, "same": drafter, "3": eagle3}, prompts=PROMPTS,
                                max_new_tokens=14, depth=3, long_context_tokens=48, progress=False)
    datas = {k: r.to_dict() for k, r in reports.items()}
    alone = _run(parts).to_dict()
    assert datas["3.1"]["conditions"] == alone["conditions"]  # the same numbers as the diagnostic of one drafter
    for d in datas.values():
        for cond, c in d["conditions"].items():
            assert sum(r["accepted"] for r in d["runs"] if r["condition"] == cond) == sum(c["accepted"])
    assert datas["3"]["meta"]["eagle31"] == {"fc_norm": False, "norm_output": False}
    assert datas["3"]["conditions"]["clean"]["fused_inputs"]["tap_norm_after_fc_norm"] is None
    result = compare(datas)
    for cond, row in result["conditions"].items():
        same = row["paired"]["same"]
        assert same["runs"] == len(PROMPTS) and same["mean_difference"] == 0.0 and same["wins"] == same["losses"] == 0
        assert row["paired"]["3"]["runs"] == len(PROMPTS)
    table = compare_markdown(datas)
    assert "τ 3.1 | τ same | τ 3" in table and table.count("\n") == 2 + len(CONDITIONS)
    out = save_comparison(datas, tmp_path / "cmp")
    assert json.loads((out / "compare.json").read_text()) == json.loads(json.dumps(result))
    assert (out / "comparison.png").stat().st_size > 10_000


def test_drafters_reading_other_layers_are_refused_before_compute(parts, monkeypatch):
    from eagle_hf.tools import diagnose as diag

    target, tok, drafter = parts
    other = tiny_drafter(target, seed=4)
    other.config.aux_layer_ids = [0, 1, 2] if drafter.config.aux_layer_ids != [0, 1, 2] else [0, 1, 3]
    monkeypatch.setattr(diag, "greedy_path", lambda *a, **k: (_ for _ in ()).throw(AssertionError("computed")))
    with pytest.raises(DiagnoseError, match="must read the same layers"):
        diag.diagnose_drafters(target, tok, {"a": drafter, "b": other}, prompts=PROMPTS, progress=False)


def test_cli_compare_writes_both_reports_and_the_comparison(parts, tmp_path, monkeypatch, capsys):
    from eagle_hf.cli import main
    from eagle_hf.drafter import default

    target, tok, drafter = parts
    eagle3 = tiny_drafter(target, seed=3, fc_norm=False, norm_output=False)
    monkeypatch.setattr(default, "load_target", lambda *a, **k: (target, tok))
    monkeypatch.setattr(default, "load_drafter",
                        lambda name, *a, **k: (eagle3, "tiny EAGLE-3") if name == "e3" else (drafter, "tiny EAGLE-3.1"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(PROMPTS)))
    out = tmp_path / "out"
    rc = main(["diagnose", "--prompts", str(prompts), "--limit", "2", "--depth", "3", "--max-new-tokens", "12",
               "--long-context-tokens", "40", "--compare", "e3", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "τ EAGLE-3.1 (tiny EAGLE-3.1) | τ EAGLE-3 (tiny EAGLE-3) |" in printed
    assert (out / "compare.md").is_file() and (out / "comparison.png").is_file()
    assert json.loads((out / "drafter_1" / "drift.json").read_text())["meta"]["drafter"] == "EAGLE-3 (tiny EAGLE-3)"
