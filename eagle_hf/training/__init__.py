"""Drafter training: prompts -> regenerated answers with hidden states -> draft vocab -> TTT training."""
