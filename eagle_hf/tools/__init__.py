"""Tools around the library: the benchmark and its per-set comparison, prompt sets, the drift diagnostic, the
drift comparison, displays of accepted and rejected drafts, the sync probe."""
