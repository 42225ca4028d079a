"""What a run's results become: the terminal table (`terminal`), HTML, JUnit and Markdown
reports, the CI gate (`compare`), the published results (`publish`); output paths checked before
any work (`output_paths`), files written atomically (`conformance.atomic_write`)."""
