"""What runs a case: the paged batch drawn for it (`batch`), one step driven eagerly (`step`) or
under CUDA graphs (`graphs`, `graph_batches`, `draft_loop`) or through continuous batching
(`continuous_batch`), the watch on its inputs (`input_watch`), the map of the memory it allocated
(`allocation_map`) and, for an fp8 layer, the stored cache (`stored_cache`); and what the checks
share to judge it: equal to the oracle (`comparison`, `error_map`, `evidence`), the NaN-poison pass
(`nan_poison`), the log-sum-exp (`lse_pass`, `lse_merge`), the engine runs and their model
(`engine_runs`, `engine_model`), the parameter × path matrix (`coverage`). Checks live in
``conformance/checks`` and hold nothing else."""
