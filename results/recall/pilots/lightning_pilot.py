"""Pilot: one Lightning recall run (diffmm.train.recall_run.train_recall, warmup + cosine) and its evaluation table.

    PYTHONPATH=. python results/recall/pilots/lightning_pilot.py --vocab 64 --lens 64 --pairs 2 4 8 --steps 1000
"""
import sys, json, time, torch, argparse
torch.set_num_threads(1)
from diffmm.data.recall import task_grid
from diffmm.train.recall_run import RecallTrainConfig, train_recall, matched_lm_kwargs, param_counts
from diffmm.eval.recall import evaluate_recall
p=argparse.ArgumentParser()
p.add_argument("--att",default="standard"); p.add_argument("--E",type=int,default=64); p.add_argument("--H",type=int,default=4)
p.add_argument("--L",type=int,default=2); p.add_argument("--vocab",type=int,default=256)
p.add_argument("--lens",type=int,nargs="+",default=[64,128]); p.add_argument("--pairs",type=int,nargs="+",default=[4,8,16])
p.add_argument("--elens",type=int,nargs="+",default=[64,128,256]); p.add_argument("--epairs",type=int,nargs="+",default=[4,8,16])
p.add_argument("--noise",type=float,default=1.0); p.add_argument("--steps",type=int,default=800)
p.add_argument("--bs",type=int,default=32); p.add_argument("--bt",type=int,default=None)
p.add_argument("--lr",type=float,default=3e-3); p.add_argument("--wd",type=float,default=0.1); p.add_argument("--seed",type=int,default=0)
p.add_argument("--out")
a=p.parse_args()
kw=matched_lm_kwargs(a.att,a.E,a.H,a.L,a.vocab,512)
tasks,_=task_grid(a.vocab,a.lens,a.pairs,noise=a.noise)
cfg=RecallTrainConfig(tasks,steps=a.steps,batch_size=a.bs,batch_tokens=a.bt,lr=a.lr,min_lr=a.lr/10,warmup=max(1,a.steps//20),weight_decay=a.wd,log_every=20)
run=train_recall(kw,cfg,a.seed,label=f"{a.att}-E{a.E}")
et,_=task_grid(a.vocab,a.elens,a.epairs,noise=a.noise)
t=time.perf_counter()
r=evaluate_recall(run.model,et,examples=64,seed=a.seed,measure_attention=True,attention_examples=16,show_progress=False)
print(vars(a)); print("params",param_counts(kw)); print("train s",round(run.seconds),"eval s",round(time.perf_counter()-t))
print(r.to_markdown(a.att))
if a.out: json.dump({"args":vars(a),"params":param_counts(kw),"train":run.summary(),"eval":r.to_dict()},open(a.out,"w"))
