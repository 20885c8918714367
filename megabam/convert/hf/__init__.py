"""The files a Hugging Face export ships (megabam/convert/hf_export.py copies them): configuration and
modeling code that import only torch, transformers and the megabam model sources bundled beside them."""
