"""Tools the tests share that are not fixtures: network namespaces, proxies, transports,
readers of the deployment files. Imported as ``tests.helpers.<module>``."""
