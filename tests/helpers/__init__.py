"""Test helpers: tiny real model files built on the fly (no model hub needed)."""
