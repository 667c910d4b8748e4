"""The task's text: the prompt template, the answer grader and the reward function VERL calls."""
