"""How longdoc runs as processes: the launched world and its process group (launch), local gloo ranks (spawn),
memory budgets shared by the trainer, evaluations and planner (budgets), and the files read at run time
(resources). Imports only torch and longdoc.errors, so every layer below the CP core can use it."""
