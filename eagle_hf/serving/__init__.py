"""`eagle-hf serve`'s own parts, apart from transformers' server (`eagle_hf.hf.serving` builds on it): what a
request may ask (`requests`) and what the calls drafted and got accepted (`metrics`). See docs/serving.md."""
