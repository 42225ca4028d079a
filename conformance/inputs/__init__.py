"""What a check hands a backend: cases (`cases`, `case_data`), the paged batch drawn for one
(`batch`), the float64 oracle (`oracle`), and the harnesses that drive one step eagerly
(`harness`) or under CUDA graphs (`graph_harness`, `graph_batches`)."""
