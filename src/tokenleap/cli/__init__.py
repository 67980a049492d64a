"""The ``tokenleap`` command line."""
