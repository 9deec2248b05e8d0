"""What each argument of `generate()` does with a drafter: one table, checked against transformers' own list by
tests/test_generate_arguments.py and shown in docs/usage.md (`table_markdown`).

Every `GenerationConfig` field and every named parameter of `generate()` of the installed transformers has a
row (the test fails on one without: a new transformers release shows its new arguments as unclassified, never as
silently passing). A row says what holds in every mode (the default, tree, chain,
copies alone) at batch 1 and in a left-padded batch of 2, and gives the value the test passes:

* ``"equal"``: greedy output equals plain `generate()` token for token (float32);
* ``"sampling"``: shapes the distribution `do_sample=True` draws from; drafting keeps that distribution (the
  sampling tests), the test checks that it runs;
* ``"refused"``: an `EagleCompatibilityError` naming the argument, before any compute;
* ``"transformers"``: transformers itself refuses it, or ignores it, for a decoder-only model without a drafter
  too (beam search, contrastive search, DoLa, constrained beams, ...): nothing eagle_hf adds;
* ``"internal"``: not an argument a user passes (bookkeeping of `GenerationConfig`, or eagle_hf's own drafter).
"""

from __future__ import annotations

#: argument -> (verdict, the value the test passes (None: none passed), what to know)
ARGUMENTS: dict[str, tuple[str, object, str]] = {
    # ---------------------------------------------------------------- length and stopping
    "max_new_tokens": ("equal", 9, ""),
    "max_length": ("equal", 20, ""),
    "min_new_tokens": ("equal", 6, ""),
    "min_length": ("equal", 16, ""),
    "max_time": ("equal", 60.0, "checked once per round (a round emits several tokens)"),
    "eos_token_id": ("equal", [5, 9], ""),
    "pad_token_id": ("equal", 0, ""),
    "bos_token_id": ("equal", 1, ""),
    "stop_strings": ("equal", None, "with `tokenizer=`: tests/test_generate_arguments.py"),
    "stopping_criteria": ("equal", None, "evaluated on every prefix of a round's tokens"),
    "early_stopping": ("transformers", True, "beam search only"),
    # ---------------------------------------------------------------- logits processing (greedy too)
    "repetition_penalty": ("equal", 1.3, ""),
    "encoder_repetition_penalty": ("equal", 1.2, "on a decoder-only model: the prompt"),
    "no_repeat_ngram_size": ("equal", 2, ""),
    "encoder_no_repeat_ngram_size": ("equal", 2, "on a decoder-only model: the prompt"),
    "bad_words_ids": ("equal", [[5], [7, 8]], ""),
    "sequence_bias": ("equal", {(5,): 2.0}, ""),
    "suppress_tokens": ("equal", [3, 4], ""),
    "begin_suppress_tokens": ("equal", [3, 4], ""),
    "forced_bos_token_id": ("equal", 3, ""),
    "forced_eos_token_id": ("equal", 4, ""),
    "exponential_decay_length_penalty": ("transformers", None, "needs an EOS id; as plain generate()"),
    "remove_invalid_values": ("equal", True, ""),
    "renormalize_logits": ("equal", True, ""),
    "logits_processor": ("equal", None, "applied at every tree node with its own prefix"),
    "prefix_allowed_tokens_fn": ("equal", None,
                                 "called per node with its prefix; a batch: refused (it takes the batch index)"),
    "watermarking_config": ("equal", {"greenlist_ratio": 0.25}, ""),
    # ---------------------------------------------------------------- sampling
    "do_sample": ("sampling", True, "lossless: the sampling tests"),
    "temperature": ("sampling", 0.7, ""),
    "top_k": ("sampling", 5, ""),
    "top_p": ("sampling", 0.8, ""),
    "min_p": ("sampling", 0.1, ""),
    "top_h": ("sampling", 0.5, ""),
    "typical_p": ("sampling", 0.9, ""),
    "epsilon_cutoff": ("sampling", 3e-4, ""),
    "eta_cutoff": ("sampling", 3e-4, ""),
    "num_return_sequences": ("sampling", 2, "rows of the batch; greedy: refused by transformers"),
    # ---------------------------------------------------------------- outputs
    "return_dict_in_generate": ("equal", True, ""),
    "output_scores": ("equal", True, "per emitted token"),
    "output_logits": ("equal", True, "per emitted token"),
    "output_hidden_states": ("equal", True,
                             "batch 1; a batch: refused (per-step hidden states of rows that draft apart)"),
    "output_attentions": ("transformers", True, "with return_dict_in_generate: decodes plainly (a warning), attentions as plain generate()'s"),
    "streamer": ("equal", None, "tests/test_generate.py"),
    # ---------------------------------------------------------------- cache and compile
    "use_cache": ("refused", False, "drafts are verified against the KV cache"),
    "cache_implementation": ("equal", "static", "tests/test_static_cache.py"),
    "max_cache_len": ("equal", 64, "with a static cache"),
    "cache_config": ("internal", None, "a cache's own settings"),
    "compile_config": ("equal", None, "tests/test_static_cache.py"),
    "disable_compile": ("equal", True, ""),
    "prefill_chunk_size": ("equal", 4, ""),
    "low_memory": ("transformers", True, "beam search only"),
    # ---------------------------------------------------------------- generation modes of transformers' own
    "num_beams": ("refused", 2, "beam search and speculative decoding do not combine"),
    "num_beam_groups": ("transformers", 2, "group beam search (a custom_generate repository now)"),
    "diversity_penalty": ("transformers", 0.5, "group beam search"),
    "length_penalty": ("transformers", 0.5, "beam search only"),
    "penalty_alpha": ("transformers", None, "contrastive search (a custom_generate repository now)"),
    "dola_layers": ("transformers", None, "DoLa (a custom_generate repository now)"),
    "force_words_ids": ("transformers", None, "constrained beam search (a custom_generate repository now)"),
    "constraints": ("transformers", None, "constrained beam search"),
    "guidance_scale": ("refused", 1.5, "classifier-free guidance needs an unconditional forward each step"),
    "negative_prompt_ids": ("transformers", None, "with guidance_scale only"),
    "negative_prompt_attention_mask": ("transformers", None, "with guidance_scale only"),
    "token_healing": ("transformers", None, "needs tokenizer=; not combined with a drafter here"),
    "synced_gpus": ("transformers", None, "multi-GPU FSDP/DeepSpeed ZeRO-3 decoding"),
    "continuous_batching_config": ("transformers", None, "generate_batch(), not generate()"),
    "custom_generate": ("internal", None, "eagle_hf's loop is transformers' custom_generate hook"),
    # ---------------------------------------------------------------- assisted decoding's own settings
    "assistant_model": ("internal", None, "the drafter"),
    "num_assistant_tokens": ("equal", 3, "the chain's length / the tree's depth"),
    "num_assistant_tokens_schedule": ("equal", "constant", "'adaptive' (default) or 'constant'"),
    "assistant_confidence_threshold": ("equal", 0.2, "prunes drafts below it"),
    "prompt_lookup_num_tokens": ("transformers", None, "transformers' prompt lookup: one or the other"),
    "max_matching_ngram_size": ("equal", 2, "prompt lookup's; eagle_hf's copies: copy_ngram"),
    "assistant_early_exit": ("transformers", None, "transformers' self-speculation"),
    "assistant_ensemble_weight": ("transformers", None, "transformers' assistant ensembles"),
    "assistant_lookbehind": ("equal", 5, "universal assisted decoding's (different tokenizers)"),
    "target_lookbehind": ("equal", 5, "universal assisted decoding's (different tokenizers)"),
    "is_assistant": ("internal", None, ""),
    "speculation_type": ("transformers", None, "transformers' multi-token prediction"),
    "use_mtp": ("transformers", None, "transformers' multi-token prediction"),
    # ---------------------------------------------------------------- not arguments
    "inputs": ("internal", None, "the prompt"),
    "generation_config": ("equal", None, "its fields as the keywords above"),
    "kwargs": ("internal", None, "model inputs and the fields above"),
    "decoder_start_token_id": ("transformers", None, "encoder-decoder models"),
    "transformers_version": ("internal", None, ""),
    "_from_model_config": ("internal", None, ""),
}

VERDICTS = ("equal", "sampling", "refused", "transformers", "internal")


def table_markdown() -> str:
    """The table as docs/usage.md shows it (rows in `ARGUMENTS` order)."""
    lines = ["| argument | with a drafter | note |", "|---|---|---|"]
    words = {"equal": "same output as without", "sampling": "same distribution", "refused": "refused with an error",
             "transformers": "as without a drafter (transformers' own rule)", "internal": "-"}
    for name, (verdict, _, note) in ARGUMENTS.items():
        if verdict != "internal":
            lines.append(f"| `{name}` | {words[verdict]} | {note} |")
    return "\n".join(lines)
