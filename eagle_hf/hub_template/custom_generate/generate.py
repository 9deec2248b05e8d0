"""transformers `custom_generate` entry point for EAGLE drafting (chain or dynamic tree).

    out = model.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True,
                         drafter="<drafter repo or folder>", draft_mode="tree", max_new_tokens=256)
"""


def generate(model, *args, drafter=None, draft_mode="tree", **kwargs):
    import eagle_hf  # noqa: F401  (installs the generate() hooks)
    from eagle_hf import EagleDrafter

    if drafter is None:
        raise ValueError("Pass the EAGLE drafter: generate(..., custom_generate=..., drafter='<repo or folder>').")
    if not isinstance(drafter, EagleDrafter):
        drafter = EagleDrafter.from_pretrained(drafter)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("attention_mask",)}
    kwargs.pop("assistant_model", None)
    return model.generate(*args, assistant_model=drafter, draft_mode=draft_mode, **kwargs)
