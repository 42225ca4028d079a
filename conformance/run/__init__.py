"""A run: every backend through every check (`runner`), each backend in an isolated child
(`isolation`: the parent, and the child that runs `execution`), with the environment it ran
in (`environment`), a journal of finished cases (`journal`) and clean interrupts (`interrupts`)."""
