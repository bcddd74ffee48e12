"""blockwork.interop: Hugging Face checkpoints in and out (no network, no torch needed).

    from interop import import_hf_dir, export_hf_dir, load_hf_dir
"""

from interop.hf import export_hf_dir, import_hf_dir, load_hf_dir

__all__ = ["export_hf_dir", "import_hf_dir", "load_hf_dir"]
