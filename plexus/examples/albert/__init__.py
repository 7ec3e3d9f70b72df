"""Collaborative ALBERT pre-training: corpus, tokenizer, model, trainer, monitor and the local demo.

The scripts in the repository's examples/albert/ run these modules (`python run_trainer.py ...`
there is `python -m plexus.examples.albert.run_trainer ...`); examples/albert/README.md is the
tutorial. They need the `albert` extra: pip install "plexus[albert]".
"""
