"""fsdp-train's model presets (trainer/model/presets.json, the one place their shapes are written)
as Hugging Face LlamaConfig fields, by name, for the scripts that build or count the same models."""

import json
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer", "model", "presets.json")


def hf_presets():
    return {name: config for name, config in json.load(open(PATH)).items() if name != "about"}
