"""What makes a case: its grammar (`grammar`), the suites (`suites`), the data drawn for it
(`random_data`, `case_data`, the fp8 quantization in `kv_quantization`) and the float64 oracle
that says what its output must be (`oracle`)."""
