"""The planner: profile -> pipeline templates -> plan (instantiation) -> re-plan.

Pure Python + numpy; imports nothing from `elastic`.
"""

from templates.cost import StageCosts, pipeline_time
from templates.derive import DeviceSpeed, LayerCounts, derive_profile
from templates.instantiation import build_plan, choose_sizes, instantiate, split_microbatches
from templates.plan import PipelinePlan, Plan, PlanError, StagePlan, even_plan
from templates.profile import DeviceProfile, LayerProfile, MemoryModel, Profile, ProfileError
from templates.replanning import Replan, replan
from templates.search import PipelineTemplate, search_templates
from templates.template_set import PlanningError, TemplateSet, build_templates

__all__ = [
    "DeviceProfile",
    "DeviceSpeed",
    "LayerCounts",
    "LayerProfile",
    "MemoryModel",
    "PipelinePlan",
    "PipelineTemplate",
    "Plan",
    "PlanError",
    "PlanningError",
    "Profile",
    "ProfileError",
    "Replan",
    "StageCosts",
    "StagePlan",
    "TemplateSet",
    "build_plan",
    "build_templates",
    "choose_sizes",
    "derive_profile",
    "even_plan",
    "instantiate",
    "pipeline_time",
    "replan",
    "search_templates",
    "split_microbatches",
]
