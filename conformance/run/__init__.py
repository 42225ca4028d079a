"""A run: every backend through every check (`runner`), each backend in an isolated child
(`isolation` in the parent, `worker` and `execution` in the child), with the environment it ran
in (`environment`), a journal of finished cases (`journal`) and clean interrupts (`interrupts`)."""
