"""What runs a case: the paged batch drawn for it (`batch`), one step driven eagerly (`step`) or
under CUDA graphs (`graphs`, `graph_batches`), the watch on its inputs (`input_watch`), the map of
the memory it allocated (`allocation_map`) and, for an fp8 layer, the stored cache (`stored_cache`)."""
