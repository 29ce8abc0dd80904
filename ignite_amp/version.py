"""The package version: a leaf module, so low layers (run facts) can name it without importing the package."""
__version__ = "0.2.0"
