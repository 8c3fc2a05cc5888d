"""``paramshard demo`` and the worker it runs, installed with the package (a wheel has them too).

``run`` (the command: a local fleet, its workers, the comparison), ``digits_worker`` (a Downpour
SGD worker training a small network on scikit-learn's digits through the SDK, also run by
``examples/digits_worker.py`` and the container image's demo target), ``workers`` (the worker
processes and their output), ``reference`` (the same training in one process, the yardstick).

``digits_worker`` is a worker: it imports the SDK (and scikit-learn, numpy), never the rest of
``server``. Importing this package imports nothing.
"""
