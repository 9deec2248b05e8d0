"""The EAGLE-3 / EAGLE-3.1 drafter: its model and config, every published checkpoint layout, the target layers it
reads, and the embedded default (SmolLM2 and the shipped drafter)."""
