"""Drafter interchange with the serving engines and training stacks.

formats.py  pure config builders/translators, one reason per key (what each engine reads)
sources.py  resolve any drafter directory (draftsman, SGLang/SpecForge, vLLM, SafeAILab/EAGLE,
            speculators, SpecForge training state) into a flat config + tensor stream
export.py   write a loaded drafter for SGLang, vLLM or speculators
"""

from draftsman.interop.formats import EXPORT_FORMATS

__all__ = ["EXPORT_FORMATS"]
