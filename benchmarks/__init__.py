"""Measurements of eagle_hf that travel with the checkout (not part of the eagle_hf distribution)."""
