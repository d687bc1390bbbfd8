"""What the stages apply: data curation, training through axolotl, compression through
llm-compressor and llama.cpp, and the measurements stages take (losses, agreement, acceptance,
weight statistics). Stages import these; these import only the plumbing (``core``) and the runtime."""
