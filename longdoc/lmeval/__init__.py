"""lm-evaluation-harness on the CP machinery: the `longdoc` lm-eval model (`pip install 'longdoc[eval]'`).

    python -m longdoc.lmeval --model longdoc --model_args pretrained=SmolLM2-135M-Instruct --device cpu \\
        --tasks my_task --include_path my_tasks/                                    # one process, cp=1
    python -m longdoc.lmeval --model longdoc --model_args pretrained=runs/demo/final,cp=2 --device cpu \\
        --tasks my_task --include_path my_tasks/              # no launcher, no CUDA: starts its 2 CPU ranks itself
    torchrun --nproc_per_node 2 -m longdoc.lmeval --model longdoc --device cpu \\
        --model_args pretrained=runs/demo/final,cp=2 --tasks my_task --include_path my_tasks/ --output_path out/
    accelerate launch --multi_gpu --num_processes 2 -m longdoc.lmeval --model longdoc --model_args ...,cp=2 ...

`python -m longdoc.lmeval` is lm-eval's own command line (every lm-eval flag works) with the longdoc model
registered and results written by global rank 0 only. The package also declares the entry point
`lm_eval.models: longdoc`, so `lm_eval --model longdoc` finds it in lm-eval releases that load model
plugins from entry points; lm-eval 0.4.13 does not yet, hence the module. From Python:

    import lm_eval, longdoc.lmeval.model                          # importing registers "longdoc"
    lm_eval.simple_evaluate(model="longdoc", model_args="pretrained=tiny:llama", tasks=[...])

    model.py     LongDocLM: loglikelihood, loglikelihood_rolling, generate_until with CP prefill and decoding
    cli.py       the command line: checks in the parent, local ranks for cp=N without a launcher
"""
