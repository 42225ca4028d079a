"""What a run's results become: the terminal table (`terminal`), HTML, JUnit and Markdown
reports, the CI gate (`compare`), the published results (`publish`), written atomically
(`output_paths`)."""
