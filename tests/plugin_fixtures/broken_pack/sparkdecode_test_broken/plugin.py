"""Stands for a pack whose kernel library is missing: importing it fails."""

raise ImportError("sparkdecode_test_broken needs the library no_such_kernel_library")
