"""The test suite; tests/README.md says what each folder covers and how to run one."""
