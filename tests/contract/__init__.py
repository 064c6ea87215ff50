"""The semaphore contract, over both classes: granting, waiting, order, cancellation, holding, relay, leaks."""
