"""Evaluation of adapter revisions: the lm-eval suites (`suites`), scoring a revision served or in process
(`lm_eval_runner`), the `mint eval` commands (`cli`) and the promotion gate (`gate`)."""
