"""The examples in ``examples/``, run as a user runs them."""
