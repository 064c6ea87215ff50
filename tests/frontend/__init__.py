"""The front end: configuration, decorators and limiters by name, rates, the CLI, observers, errors, the public API."""
