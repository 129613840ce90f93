"""Documents in, token sequences out: ingestion, synthetic legal/medical documents with QA, windows.

    longdoc data synth --domain legal --num-docs 4 --tokens 32768 --seed 0 --out legal.jsonl
    longdoc data prepare legal.jsonl --task qa --target-tokens 32768 --out runs/data/legal-qa

    from longdoc.corpus.synth import synthesize        # -> list of records (document + QA)
    from longdoc.corpus.prepare import prepare, save    # -> datasets.Dataset of token rows
    from longdoc.corpus.qa_format import qa_parts       # the QA prompt, shared with evaluation
    from longdoc.corpus.chat import chat_row            # a conversation -> a row, loss on its assistant turns
    from longdoc.corpus.ingest import CorpusError, Fields, Skips

Formats: data/README.md.
"""
