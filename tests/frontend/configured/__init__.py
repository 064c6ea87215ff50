"""What goes through `aiosem.configure`: each test starts unconfigured and ends with aiosem closed (see conftest)."""
